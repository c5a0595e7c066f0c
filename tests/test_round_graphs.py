"""engine/device/round_graph.py: the middle level's passes over persistent buffers.

A CUDA graph replays the kernels it captured over the addresses it captured, with the host
values it captured. On the CPU the same buckets replay eagerly over the same buffers
(`EagerReplay`), and `ReplayGuard` fails any replay whose attention reads another tensor
or another host value than the bucket's first run: what a real graph would silently
freeze. Here: the buffers' padding (pure tensors), the guard failing when it should, and
engines with `round_graphs` giving today's tokens, selections and acceptance, two and
three levels, while padding writes no real KV slot.
"""

import pytest
import torch

from vllm_triforce.engine.device.capture import CaptureBuffers, LayerCapture
from vllm_triforce.engine.device.forward import build_pass
from vllm_triforce.engine.device.bounds import RoundBounds
from vllm_triforce.engine.device.round_graph import (PADDING_SLOT, PassBuffers, ReplayGuard,
                                                     ReplayMismatch, RoundGraphs)


def bounds(**over) -> RoundBounds:
    kwargs = dict(budget_blocks=5, block_size=4, gamma1=0, gamma2=4, refresh_interval=1,
                  drafting=8, max_blocks=64, max_batched_tokens=2048)
    kwargs.update(over)
    return RoundBounds.of(**kwargs)


def test_buckets_cover_every_pass_up_to_the_largest():
    b = bounds(drafting=40, gamma1=1)  # 40 requests of up to 2 tokens: 80 tokens
    assert b.max_tokens == 80 and b.buckets[-1] == 80 and b.max_requests == 40
    assert [b.bucket(t, 1) for t in (1, 3, 5, 17, 49, 80)] == [1, 4, 8, 24, 64, 80]
    assert b.bucket(81, 1) is None
    assert b.requests_of(4) == 4 and b.requests_of(80) == 40
    assert b.max_query_len == 2


def test_width_bound_holds_the_budget_and_a_step_of_tail_growth():
    # 5 budget blocks of 4 tokens; after a selection the tail gains at most
    # 1 (interval) + 4 (gamma2) + 1 (gamma1 + 1) = 6 tokens: 2 more blocks, and one for
    # a tail block that starts part-full
    b = bounds()
    assert b.max_width == 5 + 2 + 1 and b.max_seq_len == 8 * 4
    assert b.bucket(1, 8) == 1 and b.bucket(1, 9) is None
    assert bounds(max_blocks=6).max_width == 6  # never wider than a max_model_len request


def test_the_pool_is_measured_by_its_own_segments(monkeypatch):
    """The round graphs' memory is their private pool's segments, as torch's CUDA-graph
    trees count them, not the change in `memory_reserved` around the capture (each
    `torch.cuda.graph` empties the allocator's cache first, so an H200 logged
    -1,296 MiB "more reserved" for 8 captured graphs)."""
    graphs = object.__new__(RoundGraphs)
    graphs._pool = None
    assert graphs.pool_bytes() == 0  # nothing captured yet
    graphs._pool = (0, 7)
    segments = [{"segment_pool_id": (0, 7), "total_size": 2 << 20},
                {"segment_pool_id": (0, 0), "total_size": 5 << 30},  # the default pool
                {"segment_pool_id": (0, 8), "total_size": 3 << 20},  # vLLM's graphs' pool
                {"segment_pool_id": (0, 7), "total_size": 1 << 20}]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    assert graphs.pool_bytes() == 3 << 20


def test_load_pads_so_nothing_is_written_or_read():
    """Three requests of [2, 1, 1] tokens in the 8-token bucket: padded tokens get slot -1,
    id 0 and position 0; padded requests repeat the last query start and have length 0."""
    b = bounds(gamma1=1)
    buffers = PassBuffers(b, num_tables=2, device="cpu")
    table = torch.tensor([[10, 11], [20, 21], [30, 31]], dtype=torch.int32)
    inputs = build_pass([[7, 8], [9], [5]], [[5, 6], [2], [3]], table, 4, [7, 3, 4])
    tables = torch.arange(2 * 3 * 2, dtype=torch.int32).view(2, 3, 2)
    bucket = b.bucket(inputs.num_tokens, 2)
    assert bucket == 4 and b.requests_of(bucket) == 4
    buffers.slot_mapping.fill_(99)  # what an earlier round could have left
    buffers.load(inputs, tables, bucket, b.requests_of(bucket))
    assert buffers.input_ids[:4].tolist() == [7, 8, 9, 5]
    assert buffers.slot_mapping[:4].tolist() == [45, 46, 82, 123]
    buffers.load(build_pass([[7], [9]], [[5], [2]], table[:2], 4, [6, 3]), tables[:, :2], 2, 2)
    assert buffers.slot_mapping[:2].tolist() == [45, 82]
    assert buffers.slot_mapping[2:4].tolist() == [82, 123]  # past bucket 2: left, never read
    buffers.load(inputs, tables, 8, 4)  # the same pass in the 8-token bucket
    assert buffers.slot_mapping[4:8].tolist() == [PADDING_SLOT] * 4
    assert buffers.input_ids[4:8].tolist() == [0] * 4 and buffers.positions[4:8].tolist() == [0] * 4
    assert buffers.query_start_loc[:5].tolist() == [0, 2, 3, 4, 4]
    assert buffers.seq_lens[:4].tolist() == [7, 3, 4, 0]
    assert torch.equal(buffers.tables[:, :3, :2], tables)


@pytest.mark.parametrize("ids_on,compiled", [("host", False), ("device", False),
                                              ("device", True)])
def test_load_runs_writes_what_build_pass_then_load_write(ids_on, compiled):
    """The middle level's load straight from the host's values (`load_runs`: one copy to
    the device, the tables laid out into the buffer) leaves every buffer as today's
    `build_pass`, `laid_out_tables` and `load` do, padding included. Three requests of
    [2, 1, 1] tokens at 5, 2 and 3, in the 8-token bucket; the first holds its sink block
    and a tail from block 1, the others a tail from block 0. `compiled`: the tables and
    slots by the compiled layout (`compiled_selection`)."""
    import numpy as np

    from vllm_triforce.core.blocks import PAD
    from vllm_triforce.core.tables import TableLayout, laid_out_tables
    from vllm_triforce.engine.device.forward import Runs

    b = bounds(gamma1=1)
    table = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]], dtype=torch.int32)
    selected = torch.full((3, 2, 2), PAD, dtype=torch.int32)  # the engine's selections
    selected[0, :, 0] = 0
    runs = Runs(np.array([5, 2, 3]), np.array([2, 1, 1]))
    layout = TableLayout.of([1, 0, 0], [1, 0, 0], runs.starts + runs.lens, 4)
    assert layout.compact_lens == [7, 3, 4] and layout.width == 2
    today, direct = PassBuffers(b, num_tables=2, device="cpu"), PassBuffers(b, 2, "cpu")
    for buffers in (today, direct):  # what an earlier round could have left
        for t in (buffers.input_ids, buffers.positions, buffers.slot_mapping,
                  buffers.query_start_loc, buffers.seq_lens, buffers.tables):
            t.fill_(99)
    inputs = build_pass([7, 8, 9, 5], runs, table, 4, layout.compact_lens)
    tables = laid_out_tables(selected, table, *(torch.tensor(v) for v in (
        layout.num_selected, layout.tail_start, layout.num_tails)), layout.width)
    today.load(inputs, tables, 8, b.requests_of(8))
    ids = [7, 8, 9, 5] if ids_on == "host" else torch.tensor([7, 8, 9, 5])
    if compiled:
        direct.layout.compile(num_layers=2, max_selected=2, device="cpu")
    direct.load_runs(ids, runs, table, layout, selected, 8, b.requests_of(8))
    assert (direct.layout.compiled is not None) == compiled  # it did not fall back
    assert direct.slot_mapping[:8].tolist() == [45, 46, 82, 123] + [PADDING_SLOT] * 4
    assert direct.tables[:, :3, :2].tolist() == [[[10, 11], [20, 0], [30, 0]]] * 2
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
                 "tables"):
        assert torch.equal(getattr(direct, name), getattr(today, name)), name


@pytest.mark.parametrize("ids_on", ["host", "device"])
def test_load_host_writes_what_the_small_drafts_build_pass_then_load_write(ids_on):
    """The small draft's load from the host's description of its pass (`load_host`: one
    copy, one gather of blocks) leaves every buffer as the per-pass path's `build_pass`
    and `load` do, padding included. Batch rows 2, 0 and 1 of a window of one sink and
    two window blocks of 4: [20, 21, 22] rebased by 8; the sinks and [8, 9]; [5], whose
    table has a column past its blocks (read as column 0: never read)."""
    from types import SimpleNamespace

    from vllm_triforce.core.streaming import DraftWindow
    from vllm_triforce.engine.draft_level import DraftLevel

    window = DraftWindow(num_sink_blocks=1, num_window_blocks=2, block_size=4,
                         max_draft_position=40, lookahead=4)
    b = RoundBounds.of_draft(3, 4, gamma1=2, gamma2=4, drafting=4, max_batched_tokens=2048)
    block_table = torch.randperm(100, dtype=torch.int32)[:24].view(3, 8) + 1
    states = [SimpleNamespace(draft_rebase_offset=o) for o in (0, 0, 8)]
    rows, positions = [2, 0, 1], [[20, 21, 22], [0, 1, 2, 3, 8, 9], [5]]
    ids = [[7, 8, 9], [1, 2, 3, 4, 5, 6], [11]]
    level = object.__new__(DraftLevel)
    level.window = window
    host = level._host_pass(SimpleNamespace(block_table=block_table), states, rows, positions)
    assert host.positions.tolist() == [12, 13, 14, 0, 1, 2, 3, 8, 9, 5]
    assert host.columns.tolist() == [[0, 4, 5], [0, 1, 2], [0, 1, -1]]
    assert host.seq_lens.tolist() == [11, 10, 6]
    bucket = b.bucket(host.num_tokens, 3, 6)
    assert bucket == 16 and b.requests_of(bucket) == 4
    today, direct = PassBuffers(b, num_tables=1, device="cpu"), PassBuffers(b, 1, "cpu")
    for buffers in (today, direct):  # what an earlier round could have left
        for t in (buffers.input_ids, buffers.positions, buffers.slot_mapping,
                  buffers.query_start_loc, buffers.seq_lens, buffers.tables):
            t.fill_(99)
    mine = block_table[torch.tensor(rows)]
    table = mine.gather(1, torch.from_numpy(host.columns).clamp(min=0))  # today's path's
    rebased = [[window.position(p, states[r].draft_rebase_offset) for p in ps]
               for r, ps in zip(rows, positions)]
    inputs = build_pass(ids, positions, mine, 4, host.seq_lens.tolist(), sample_last=True,
                        model_positions=rebased)
    today.load(inputs, table[None], bucket, 4)
    flat = [t for ts in ids for t in ts]
    direct.load_host(flat if ids_on == "host" else torch.tensor(flat), host, block_table,
                     bucket, 4)
    assert direct.slot_mapping[10:16].tolist() == [PADDING_SLOT] * 6
    assert direct.query_start_loc[:5].tolist() == [0, 3, 9, 10, 10]
    assert direct.tables[0, :3].tolist() == [[block_table[r, c].item() for c in cols]
                                              for r, cols in zip(rows, [[0, 4, 5], [0, 1, 2],
                                                                        [0, 1, 0]])]
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
                 "tables"):
        assert torch.equal(getattr(direct, name), getattr(today, name)), name


@pytest.mark.parametrize("inference", [False, True])
def test_the_compiled_pass_layout_is_the_eager_one_for_every_size(inference):
    """`PassLayout` compiled once gives `pass_layout`'s tables and slots for passes of 1 to
    6 requests, tables 1 to 9 columns wide and batch tables of any width, compiling
    nothing more; the selections' first columns, the tails and padding included. Also
    wholly in inference mode, as vLLM runs the engine (no argument copied)."""
    with torch.inference_mode(inference):
        _compiled_layout_for_every_size()


def _compiled_layout_for_every_size():
    from torch._dynamo.utils import counters

    from vllm_triforce.engine.device.round_graph import PassLayout

    layout = PassLayout(block_size=4)
    layout.compile(num_layers=3, max_selected=4, device="cpu")
    graphs = counters["stats"]["unique_graphs"]
    gen = torch.Generator().manual_seed(0)
    for reqs, width, table_width in [(1, 1, 2), (3, 5, 7), (6, 9, 12), (2, 4, 4)]:
        selected = torch.randint(-1, table_width, (reqs, 3, 4), generator=gen,
                                 dtype=torch.int32)
        table = torch.randint(0, 100, (reqs, table_width), generator=gen, dtype=torch.int32)
        num_selected = torch.randint(0, 5, (reqs,), generator=gen)
        tail_start = torch.randint(0, table_width, (reqs,), generator=gen)
        num_tails = torch.minimum(table_width - tail_start, width - num_selected).clamp(min=0)
        tokens = torch.randint(1, 3, (reqs,), generator=gen)
        owner = torch.repeat_interleave(torch.arange(reqs), tokens)
        positions = torch.randint(0, table_width * 4, owner.shape, generator=gen)
        args = (selected, table, num_selected, tail_start, num_tails, torch.arange(width),
                owner, positions)
        got, want = layout(*args), layout.eager(*args)
        assert layout.compiled is not None
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert counters["stats"]["unique_graphs"] == graphs  # no size compiled anew


def test_capture_buffers_views_equal_clones_and_stay_apart():
    """Persistent copies equal the clones they replace; a middle pass's buffers never
    alias vLLM's pass's, so a round cannot overwrite what the next commit reads."""
    capture = LayerCapture(num_layers=2, copy_tokens=8)
    step = capture.use_step_buffers()
    rounds = CaptureBuffers(2, 4, keep_keys=False)
    q, k = torch.randn(3, 2, 4), torch.randn(3, 1, 4)
    capture.record(0, q, k)
    assert torch.equal(capture.queries[0], q) and torch.equal(capture.keys[0], k)
    assert capture.queries[0].data_ptr() == step.buffers["query"].data_ptr()
    step_query = capture.queries[0]
    with capture.recording(into=rounds):
        capture.record(0, q * 2, k * 2)
    assert capture.keys[0] is None  # a middle pass keeps queries only
    assert torch.equal(capture.queries[0], q * 2) and torch.equal(step_query, q)
    assert rounds.buffers["query"].data_ptr() != step.buffers["query"].data_ptr()
    capture.record(1, torch.randn(9, 2, 4), None)  # larger than the buffers: by reference
    assert capture.queries[1].shape[0] == 9
    with capture.recording(into=rounds):  # a middle pass larger than its buffers: a clone
        big = torch.randn(6, 2, 4)
        capture.record(0, big, big)
    assert torch.equal(capture.queries[0], big) and capture.keys[0] is None
    assert capture.queries[0].data_ptr() != big.data_ptr() and torch.equal(step_query, q)


def test_a_replays_queries_read_per_layer_or_gathered_at_once():
    """After a replay the capture's queries are the round buffers' rows (`LayerRows`): per
    layer they equal what `record` copied in, `at` gathers rows of every layer in one
    operation as the stack of those layers would, and vLLM's next pass records a fresh
    list."""
    capture = LayerCapture(num_layers=3, copy_tokens=8)
    rounds = CaptureBuffers(3, 4, keep_keys=False)
    qs = [torch.randn(3, 2, 4) for _ in range(3)]
    with capture.recording(into=rounds):
        for layer, q in enumerate(qs):
            capture.record(layer, q, None)
    capture.take_views(rounds, 3)
    assert len(capture.queries) == 3
    assert all(torch.equal(v.view(3, 2, 4), q) for v, q in zip(capture.queries, qs))
    rows = torch.tensor([2, 0])
    stacked = torch.stack([q.reshape(3, 8) for q in qs], dim=1)[rows]  # [2, L, 8]
    assert torch.equal(capture.queries.at(rows), stacked)
    capture.record(0, qs[1], None)  # vLLM's pass
    assert isinstance(capture.queries, list) and capture.queries[1] is None
    assert torch.equal(capture.queries[0], qs[1])


def test_replay_guard_fails_a_replay_that_reads_another_table():
    """The guard is not a test that cannot fail: a bucket whose second run reads a table at
    another address, or another host value, is refused."""
    from types import SimpleNamespace

    table, lens = torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    meta = SimpleNamespace(query_start_loc=torch.zeros(3), seq_lens=lens, block_table=table,
                           slot_mapping=torch.zeros(2), num_actual_tokens=2, max_query_len=1,
                           max_seq_len=8, causal=True)
    impl = SimpleNamespace(forward=lambda layer, q, k, v, cache, m, *a, **kw: None)
    guard = ReplayGuard().install([SimpleNamespace(impl=impl)])
    cache = torch.zeros(4)

    def attend():
        impl.forward(None, None, None, None, cache, meta)

    for _ in range(2):
        with guard.watching(2):
            attend()
    assert guard.replays_checked == 1
    meta.block_table = table.clone()  # a table allocated per round
    with pytest.raises(ReplayMismatch, match="block_table"):
        with guard.watching(2):
            attend()
    meta.block_table, meta.num_actual_tokens = table, 1  # a host value decided per round
    with pytest.raises(ReplayMismatch, match="num_actual_tokens"):
        with guard.watching(2):
            attend()
    guard.remove()
    assert not hasattr(impl.forward, "__wrapped__") and guard._impls == []


# ---- engines ------------------------------------------------------------------------

SPEC = {"method": "triforce", "num_speculative_tokens": 4, "retrieval_budget": 160,
        "retrieval_sink_tokens": 16, "retrieval_recent_tokens": 32, "adaptive": False}


def _prompts(n: int) -> list[dict]:
    return [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 1 for j in range(300 + 60 * i)]}
            for i in range(n)]


def _run(llm, prompts, watch_kv: bool = False) -> dict:
    """Greedy tokens, every selection, TriForce's counters, and (`watch_kv`) the KV blocks
    each round pass over the buffers changed against the blocks its real tokens own."""
    from vllm import SamplingParams

    from engine_helpers import assert_drafted, drafter_of, record_selections, runner_of

    drafter = drafter_of(llm)
    selections = record_selections(drafter)
    recorded, table = [], drafter.retrieval.selections
    record = table.record

    def recording(rows, rows_on_device, logical, *sizes):  # every selection kept, by row
        recorded.append((rows.tolist(), logical.tolist(), [a.tolist() for a in sizes]))
        return record(rows, rows_on_device, logical, *sizes)

    table.record = recording
    graphs, writes = drafter.retrieval.round_graphs, []
    guard = draft_guard = None
    draft_graphs = drafter.draft.round_graphs if drafter.draft is not None else None
    if draft_graphs is not None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        layers = get_layers_from_vllm_config(drafter.vllm_config, Attention,
                                             draft_graphs.layer_names)
        draft_guard = draft_graphs.guard = ReplayGuard().install(list(layers.values()))
    if graphs is not None:
        guard = graphs.guard = ReplayGuard().install(drafter.target_layers)
        if watch_kv:
            caches = runner_of(llm).kv_caches
            replay = graphs.replay

            def watched_replay(loaded):
                before = [c.clone() for c in caches]
                out = replay(loaded)
                block, num_tokens = drafter.block_size, loaded.num_tokens
                changed = set()
                for was, now in zip(before, caches):  # [num_blocks, ...] on CPU_ATTN
                    diff = (was != now).reshape(was.shape[0], -1).any(-1)
                    changed |= set(torch.nonzero(diff).flatten().tolist())
                # the slots the pass's real tokens were given (the same as `build_pass`'s:
                # the tokens and selections above equal today's path)
                slots = graphs.buffers.slot_mapping[:num_tokens]
                real = set((slots // block).tolist())
                writes.append((num_tokens < loaded.bucket, changed, real))
                return out

            graphs.replay = watched_replay
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    stats = drafter.stats.snapshot()
    assert_drafted(stats, levels=3 if drafter.shape.has_draft else 2)
    round_bytes = None
    if guard is not None:
        guard.remove()
        allocated = graphs.nbytes + drafter.layer_capture.step_buffers.nbytes
        if draft_graphs is not None:
            draft_guard.remove()
            allocated += draft_graphs.buffers.nbytes
        round_bytes = (allocated, drafter.sizing.round_bytes)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "selections": selections,
            "accepted": (stats["top_proposed"], stats["top_accepted"],
                         stats["middle_proposed"], stats["middle_accepted"]),
            "recorded": recorded,
            "stats": stats, "guard": guard, "draft_guard": draft_guard, "writes": writes,
            "round_bytes": round_bytes}


@pytest.mark.engine
@pytest.mark.parametrize("levels", [2, 3])
def test_round_graphs_give_todays_tokens_selections_and_acceptance(
        levels, tiny_llama, tiny_draft, llm_factory):
    spec = dict(SPEC)
    if levels == 3:
        spec.update(model=str(tiny_draft), draft_window_tokens=96, draft_tokens_per_round=2)
    prompts = _prompts(3)  # three requests: one-token rounds pad 3 -> 4
    # a KV cache of 64 blocks of 32 (the prompts take 42): the padding check copies it per pass
    small = dict(num_gpu_blocks_override=64)
    plain = _run(llm_factory(tiny_llama, speculative_config=spec, **small), prompts)
    graphed = _run(llm_factory(tiny_llama, speculative_config=dict(spec, round_graphs=True),
                               **small), prompts, watch_kv=True)
    stats = graphed["stats"]
    assert stats["round_graph_passes"] > 0, stats
    assert graphed["guard"].replays_checked > 0
    if levels == 2:  # every middle pass fits a bucket; each after a step's first is
        # loaded before the last round's copy to the host
        assert stats["round_graph_passes"] == stats["middle_rounds"], stats
        assert stats["round_graph_misses"] == 0, stats
        assert stats["round_graph_ahead"] == (stats["middle_rounds"]
                                              - stats["drafting_steps"]), stats
    else:  # the small draft's passes too; its first passes over a prompt's window miss
        assert stats["round_graph_passes"] > stats["middle_rounds"], stats
        assert graphed["draft_guard"].replays_checked > 0
    allocated, reserved = graphed["round_bytes"]
    assert 0 < allocated <= reserved, graphed["round_bytes"]  # the memory plan holds them
    assert plain["selections"], "no selection was made: the test proves nothing"
    assert graphed["selections"] == plain["selections"]
    assert graphed["accepted"] == plain["accepted"]
    assert graphed["tokens"] == plain["tokens"]
    padded = [(changed, real) for was_padded, changed, real in graphed["writes"] if was_padded]
    assert padded, "no round ran padded: the padding check proves nothing"
    assert any(changed for changed, _ in padded), "no KV write was seen: the check is blind"
    for changed, real in padded:
        assert changed <= real, f"padding wrote KV blocks {sorted(changed - real)}"


def test_one_token_ahead_reads_as_the_drafts_will_after_the_round():
    """A round that emits one token per row (two levels) leaves each row one position on
    and its query at its index in the pass: `OneTokenAhead` says so before the round's
    tokens are read, so the re-selection can be launched before its copy to the host. The
    view and the drafts after `advance_one` agree (docstring example: rows 0 and 2 of
    three, at positions 10 and 40)."""
    import numpy as np

    from vllm_triforce.engine.middle import MiddleDrafts, positions_of

    drafts = MiddleDrafts([4, 5, 6], [3, 0, 2], np.array([1, 2, 3]),
                          np.array([10, 20, 40]), width=4)
    live = np.array([0, 2])
    ahead = drafts.after_one_token(live)
    assert [a.tolist() for a in positions_of(ahead, [6])] == [[41], [1]]
    predicted = positions_of(ahead, [4, 6])
    drafts.advance_one(live, np.array([7, 8]))
    after = positions_of(drafts, [4, 6])
    assert all((p == a).all() for p, a in zip(predicted, after)), (predicted, after)


@pytest.mark.engine
@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_round_graphs_give_todays_tokens_at_depths_that_vary(temperature, tiny_llama,
                                                             llm_factory, monkeypatch):
    """Depths that vary within and across steps (`force_depths`: 3, 1, 4, 0), greedy and
    sampled (from each engine's seed: a seed per request would fix its depth by rule):
    rows leave the middle rounds at different rounds, so a pass loaded ahead takes some of
    the round's tokens, not all (greedy: argmaxes; sampled: the draws). The same tokens,
    selections and counts as the per-pass path, with passes loaded ahead, some for fewer
    rows than the round before. The counts and selections are what a wrong input would
    move: a middle token never changes vLLM's greedy output, and at this tiny model's
    low acceptance barely its sampled one."""
    from vllm import SamplingParams

    from engine_helpers import assert_drafted, drafter_of, force_depths, record_selections
    from vllm_triforce.engine.retrieval_level import RetrievalStep

    passes = []  # ("pass" | "ahead", rows) in order
    forward, load_ahead = RetrievalStep.forward, RetrievalStep.load_ahead

    def recorded(kind, method):
        def call(self, rows, *args):
            passes.append((kind, len(rows)))
            return method(self, rows, *args)
        return call

    monkeypatch.setattr(RetrievalStep, "forward", recorded("pass", forward))
    monkeypatch.setattr(RetrievalStep, "load_ahead", recorded("ahead", load_ahead))
    params = SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True)
    runs = []
    for graphs in (False, True):
        llm = llm_factory(tiny_llama, speculative_config=dict(SPEC, adaptive=True,
                                                              round_graphs=graphs),
                          num_gpu_blocks_override=64)
        force_depths(llm, [3, 1, 4, 0])
        drafter = drafter_of(llm)
        selections = record_selections(drafter)
        passes.clear()
        outs = llm.generate(_prompts(3), params, use_tqdm=False)
        stats = drafter.stats.snapshot()
        assert_drafted(stats)
        runs.append({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                     "counts": (stats["top_proposed"], stats["top_accepted"]),
                     "selections": selections, "stats": stats})
    plain, graphed = runs
    assert graphed["stats"]["round_graph_ahead"] > 0, graphed["stats"]
    shrinking = [(a, b) for (kind_a, a), (kind_b, b) in zip(passes, passes[1:])
                 if kind_a == "pass" and kind_b == "ahead" and b < a]
    assert shrinking, f"no pass was loaded ahead for fewer rows: {passes}"
    assert plain["selections"], "no selection was made: the test proves nothing"
    assert graphed["selections"] == plain["selections"]
    assert graphed["counts"] == plain["counts"]
    assert graphed["tokens"] == plain["tokens"]


@pytest.mark.engine
def test_compiled_selection_gives_todays_tokens_selections_and_acceptance(
        tiny_llama, llm_factory, monkeypatch):
    """`compiled_selection` with round graphs (how a GPU runs them): each step's selection
    and shortlist (one compiled graph, query to both) and every shortlist re-ranking
    between middle rounds go through the compiled kernels
    (core/fused_reads.py), every middle pass's tables and slots through the compiled
    layout (engine/device/round_graph.PassLayout), the lazy block summaries through the
    compiled read of the KV cache (engine/summary_keeper.BlockReads), and the engine gives
    the eager reads' tokens, selections and drafted/accepted counts."""
    from engine_helpers import drafter_of
    from vllm_triforce.core.compiled import CompiledFunction

    prompts = _prompts(3)
    spec = dict(SPEC, round_graphs=True)
    # the same coded summaries read eagerly (a CPU keeps float ones unless asked, or compiled)
    eager = _run(llm_factory(tiny_llama, speculative_config=dict(spec, compact_summaries=True),
                             num_gpu_blocks_override=64), prompts)
    llm = llm_factory(tiny_llama, speculative_config=dict(spec, compiled_selection=True),
                      num_gpu_blocks_override=64)
    compiled = drafter_of(llm).policy.compiled
    layout = drafter_of(llm).retrieval.round_graphs.buffers.layout
    reads = drafter_of(llm).retrieval.keeper.block_reads
    assert compiled is not None and compiled.compile_seconds is not None
    assert layout.compiled is not None
    assert reads.wanted  # compiled at the first commit: enforce_eager runs no warm-up
    calls, run = [], CompiledFunction.__call__
    monkeypatch.setattr(CompiledFunction, "__call__",
                        lambda self, *a, **kw: calls.append(self) or run(self, *a, **kw))
    scored = _run(llm, prompts)
    assert compiled._listed in calls, "no shortlist was re-ranked: the test proves nothing"
    assert compiled._table in calls, "no step selected: the test proves nothing"
    assert layout.compiled in calls, "no middle pass was laid out compiled"
    assert drafter_of(llm).policy.compiled is compiled, "the kernels fell back to eager reads"
    assert layout.compiled is not None, "the pass layout fell back to eager"
    assert reads.compiled in calls, "no block summaries were read from the KV cache"
    assert reads.compiled is not None, "the read of block summaries fell back to eager"
    assert scored["selections"] == eager["selections"]
    assert scored["accepted"] == eager["accepted"]
    assert scored["tokens"] == eager["tokens"]


@pytest.mark.engine
def test_selection_graphs_give_todays_tokens_selections_and_acceptance(
        tiny_llama, llm_factory, monkeypatch):
    """`selection_graphs` (with round graphs and the compiled selection): a middle round's
    re-selection and the next pass's load run as one closure over persistent buffers per
    bucket (engine/device/selection_graph.py), the CPU's twin of its CUDA graph. At depths
    that vary (`force_depths`: 4, 3, 4, 1, 4) rows leave the rounds at different rounds, so
    some rounds re-rank a subset of the step's shortlist and take some of the round's
    tokens. Every round after a step's first is loaded that way, and every step's first
    round by the bucket's run without the re-ranking; the engine keeps the
    per-call path's selections (every one recorded, by row), tokens and drafted/accepted
    counts; no padded token writes KV (three requests run in a bucket of four); nothing
    falls back to the eager reads."""
    from engine_helpers import drafter_of, force_depths
    from vllm_triforce.engine.device.selection_graph import SelectionGraphs

    loads = []  # the requests of each selection graph's load
    load = SelectionGraphs.load
    monkeypatch.setattr(SelectionGraphs, "load",
                        lambda self, tokens, picked, *rest: loads.append(
                            (len(rest[0]), picked is not None))
                        or load(self, tokens, picked, *rest))
    prompts = _prompts(3)
    spec = dict(SPEC, adaptive=True, round_graphs=True, compiled_selection=True)
    runs = []
    for fused in (False, True):
        llm = llm_factory(tiny_llama, speculative_config=dict(spec, selection_graphs=fused),
                          num_gpu_blocks_override=64)
        force_depths(llm, [4, 3, 4, 1, 4])
        drafter = drafter_of(llm)
        graphs, compiled = drafter.retrieval.selection_graphs, drafter.policy.compiled
        layout = drafter.retrieval.round_graphs.buffers.layout.compiled
        assert (graphs is not None) == fused and compiled is not None and layout is not None
        runs.append(_run(llm, prompts, watch_kv=fused))
        # nothing fell back to the eager reads or would have compiled again
        assert drafter.policy.compiled is compiled
        assert drafter.retrieval.round_graphs.buffers.layout.compiled is layout
    per_call, fused = runs
    stats = fused["stats"]
    assert not graphs.use_cuda_graphs and graphs.failed is None
    # every drafting request re-selects at its step's start and holds the step's
    # shortlist (`RetrievalStep.select`'s middle_tokens), so every round loaded ahead is
    # loaded by a selection graph
    assert 0 < stats["round_graph_selections"] == stats["round_graph_ahead"], stats
    # and every step's first pass, over the selection its start made, by the graph
    # without the re-ranking
    assert 0 < stats["round_graph_layouts"] == (stats["round_graph_passes"]
                                                - stats["round_graph_ahead"]), stats
    assert per_call["stats"]["round_graph_selections"] == 0
    assert per_call["stats"]["round_graph_layouts"] == 0
    assert any(picked for _, picked in loads), f"no load took a subset of a round: {loads}"
    assert (4, True) in graphs.runs and (4, False) in graphs.runs, graphs.runs.keys()
    assert any(n == 3 for n, _ in loads), loads  # 3 rows, bucket 4
    assert len(fused["recorded"]) == len(per_call["recorded"]) > stats["drafting_steps"]
    assert fused["recorded"] == per_call["recorded"]
    assert fused["accepted"] == per_call["accepted"]
    assert fused["tokens"] == per_call["tokens"]
    padded = [(changed, real) for was_padded, changed, real in fused["writes"] if was_padded]
    assert padded and any(changed for changed, _ in padded), "the padding check is blind"
    for changed, real in padded:
        assert changed <= real, f"padding wrote KV blocks {sorted(changed - real)}"


@pytest.mark.engine
def test_rounds_launched_ahead_give_the_same_tokens_selections_and_acceptance(
        tiny_llama, llm_factory, monkeypatch):
    """VLLM_TRIFORCE_LAUNCH_AHEAD=1: each round's next pass, loaded ahead (here by the
    selection graphs), is replayed before the round's copy to the host is waited for
    (`RetrievalStep.launch_ahead`), and `forward` takes its logits. At depths that vary
    (4, 3, 4, 1, 4: rows leave the rounds at different rounds) every pass loaded ahead is
    launched ahead, and the engine keeps the selections, tokens and drafted/accepted counts
    of the same engine without it; the replay guard holds."""
    from engine_helpers import drafter_of, force_depths
    from vllm_triforce.engine.retrieval_level import LAUNCH_AHEAD_ENV

    prompts = _prompts(3)
    spec = dict(SPEC, adaptive=True, round_graphs=True, compiled_selection=True,
                selection_graphs=True)
    runs = []
    for ahead in (False, True):
        if ahead:
            monkeypatch.setenv(LAUNCH_AHEAD_ENV, "1")
        llm = llm_factory(tiny_llama, speculative_config=spec, num_gpu_blocks_override=64)
        force_depths(llm, [4, 3, 4, 1, 4])
        runs.append(_run(llm, prompts))
        assert drafter_of(llm).retrieval.selection_graphs is not None
    waited, launched = runs
    stats = launched["stats"]
    assert waited["stats"]["round_graph_launched_ahead"] == 0
    assert 0 < stats["round_graph_launched_ahead"] == stats["round_graph_ahead"], stats
    assert stats["round_graph_passes"] == stats["middle_rounds"], stats
    assert launched["guard"].replays_checked > 0
    assert len(launched["recorded"]) > stats["drafting_steps"]
    assert launched["recorded"] == waited["recorded"]
    assert launched["accepted"] == waited["accepted"]
    assert launched["tokens"] == waited["tokens"]
