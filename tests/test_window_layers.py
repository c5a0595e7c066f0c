"""Targets with local layers beside full-attention ones: sliding-window layers (Gemma 2 and
3, gpt-oss) and chunked ones (Llama 4). Most tests use a tiny Llama whose layers 0 and 2
attend to the last 64 tokens and layers 1 and 3 over the whole context. vLLM gives each
kind a KV-cache group of its own (its hybrid KV-cache manager), frees the blocks behind
the window and gives the two groups different block ids. TriForce selects blocks for the
full-attention layers only; every pass runs the local layers over their own group's table
at the tokens' true lengths, writing their own group's slots (engine/device/forward.py
`WindowLayers`). Greedy outputs must equal plain vLLM's with drafts verified, for that
Llama and for tiny Gemma 3, gpt-oss and Llama 4 models; the memory plan must count a
block id's bytes as vLLM does (the groups share them).
"""

import pytest

import tiny_models
from engine_helpers import assert_drafted, fixed_depth_spec, greedy_run, make_engine_kwargs
from vllm_triforce.config import TriForceConfigError

pytestmark = pytest.mark.engine

MAX_TOKENS = 40
WINDOW = 64
PROMPT_WORDS = (900, 700, 1100, 500)  # about 1,000 to 2,000 tokens


def generate(model, spec, read=None, **engine):
    """(greedy tokens, TriForce's counters, `read(drafter)` taken before the engine goes)."""
    prompts = [tiny_models.make_text(n, seed=i) for i, n in enumerate(PROMPT_WORDS)]
    return greedy_run(model, spec, prompts, MAX_TOKENS,
                      make_engine_kwargs(max_model_len=2048, **engine), read)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    return tiny_models.build_tiny_llama(
        tmp_path_factory.mktemp("windowed"), num_layers=4, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2)


@pytest.fixture(scope="module")
def plain_tokens(windowed):
    return generate(windowed, None)[0]


ARCHITECTURES = {  # name -> (builder, KV-cache groups of local layers, TriForce's group)
    "gemma3": (lambda path: tiny_models.build_tiny_gemma3(path, sliding_window=WINDOW),
               {0: 1, 1: 1, 2: 1, 3: 1, 4: 1}, 5),
    "gpt_oss": (lambda path: tiny_models.build_tiny_gpt_oss(path, sliding_window=WINDOW),
                {0: 2}, 1),
    "llama4": (lambda path: tiny_models.build_tiny_llama4(path, chunk=WINDOW),
               {0: 1, 1: 1, 2: 1}, 3),
}


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_models_of_that_kind_draft_exactly(name, tmp_path):
    """Gemma 3's pattern (five sliding layers to one full: six KV-cache groups; query-key
    norms, a RoPE base of its own in the local layers), gpt-oss's (alternating, with
    learned attention sinks and experts) and Llama 4's (three layers attending within
    chunks of the context to one over all of it, without RoPE; vLLM's chunked-local
    builder splits each request into virtual ones): with a budget past every context all
    drafts are accepted, and with 256 tokens the output is still plain vLLM's."""
    build, window_groups, table_group = ARCHITECTURES[name]
    model = build(tmp_path / name)
    plain = generate(model, None)[0]
    tokens, stats, groups = generate(
        model, fixed_depth_spec(budget=2048),
        read=lambda d: (d.table_group, {gid: len(n) for gid, n in d.windows.names.items()}))
    assert tokens == plain
    assert_drafted(stats)
    assert stats["top_accepted"] == stats["top_proposed"], stats
    assert groups == (table_group, window_groups), groups
    tokens, stats, _ = generate(model, fixed_depth_spec(budget=256))
    assert tokens == plain
    assert_drafted(stats)


@pytest.mark.parametrize("hybrid_manager", [True, False])
def test_middle_level_equals_the_target_where_it_holds_every_block(windowed, plain_tokens,
                                                                   hybrid_manager):
    """A retrieval budget past every context: the middle level reads every block, so its
    drafts are the target's own greedy tokens, and every one is accepted, only if the
    sliding-window layers read their own group's blocks. Giving them TriForce's group's
    table instead: 0 of 624 accepted. With vLLM's hybrid KV-cache manager off, the two
    kinds share one group (every block kept), and the window layers still run at true
    lengths."""
    tokens, stats, groups = generate(
        windowed, fixed_depth_spec(budget=2048),
        read=lambda d: (d.table_group, {gid: len(n) for gid, n in d.windows.names.items()},
                        len(d.target_layer_names), d.summaries.num_layers),
        disable_hybrid_kv_cache_manager=not hybrid_manager)
    assert tokens == plain_tokens
    assert_drafted(stats)
    assert stats["top_accepted"] == stats["top_proposed"], stats
    # with the manager, group 0 holds the sliding layers, group 1 TriForce's; without, one
    assert groups == ((1, {0: 2}, 2, 2) if hybrid_manager else (0, {0: 2}, 2, 2)), groups


def test_retrieval_with_sliding_window_layers_is_lossless(windowed, plain_tokens):
    """A budget of 256 tokens against contexts of about 1,000 to 2,000: the full-attention
    layers read a selection of each request's blocks. With round graphs every middle pass
    runs over the persistent buffers, the sliding-window layers' tables and slots among
    them (engine/device/round_graph.py `WindowGroup`), and drafts and accepts exactly as
    the passes built per pass do."""
    accepted = {}
    for round_graphs in (False, True):
        tokens, stats, _ = generate(windowed, fixed_depth_spec(budget=256,
                                                               round_graphs=round_graphs))
        assert tokens == plain_tokens
        assert_drafted(stats)
        accepted[round_graphs] = (stats["top_proposed"], stats["top_accepted"])
        graphed = stats["middle_rounds"] if round_graphs else 0
        assert stats["round_graph_passes"] == graphed, stats
        assert stats["round_graph_misses"] == 0, stats
    assert accepted[True] == accepted[False], accepted


@pytest.mark.parametrize("hybrid_manager", [True, False])
def test_round_graphs_run_the_window_layers_over_their_own_buffers(windowed, plain_tokens,
                                                                   hybrid_manager,
                                                                   monkeypatch):
    """Round graphs over a budget past every context: every draft is accepted only if the
    sliding-window layers read their own group's blocks from the buffers, at true
    lengths. The replay guard watches those layers too (a table or length allocated per
    round fails it), the buffers stay inside the memory plan's reservation, and loading
    TriForce's group's rows as the window layers' table is caught (hybrid manager on:
    off, the two are one group)."""
    from vllm import SamplingParams
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    from engine_helpers import drafter_of, free_llm, in_process_llm
    from vllm_triforce.engine.device.round_graph import PassBuffers, ReplayGuard

    def run():
        llm = in_process_llm(windowed, fixed_depth_spec(budget=2048, round_graphs=True),
                             **make_engine_kwargs(max_model_len=2048,
                                                  disable_hybrid_kv_cache_manager=not
                                                  hybrid_manager))
        try:
            drafter = drafter_of(llm)
            graphs = drafter.retrieval.round_graphs
            local = get_layers_from_vllm_config(drafter.vllm_config, Attention,
                                                drafter.window_layer_names)
            guard = graphs.guard = ReplayGuard().install(
                drafter.target_layers + list(local.values()))
            prompts = [tiny_models.make_text(n, seed=i) for i, n in enumerate(PROMPT_WORDS)]
            outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                        ignore_eos=True), use_tqdm=False)
            guard.remove()
            allocated = graphs.nbytes + drafter.layer_capture.step_buffers.nbytes
            return ([list(o.outputs[0].token_ids) for o in outs], drafter.stats.snapshot(),
                    guard.replays_checked, len(graphs.windows),
                    (allocated, drafter.sizing.round_bytes))
        finally:
            free_llm(llm)

    tokens, stats, checked, groups, (allocated, reserved) = run()
    assert tokens == plain_tokens
    assert_drafted(stats)
    assert stats["top_accepted"] == stats["top_proposed"], stats
    assert stats["round_graph_passes"] == stats["middle_rounds"], stats
    assert checked > 0 and groups == 1
    assert 0 < allocated <= reserved
    if not hybrid_manager:
        return
    write_windows = PassBuffers._write_windows

    def triforce_rows(buffers, tables, *args):  # the full layers' rows, not their own
        own = {gid: buffers.tables[0, :table.shape[0], :table.shape[1]]
               for gid, table in tables.items()}
        return write_windows(buffers, own, *args)

    monkeypatch.setattr(PassBuffers, "_write_windows", triforce_rows)
    _, stats, *_ = run()
    assert_drafted(stats)
    assert stats["top_accepted"] < stats["top_proposed"], stats


def test_the_memory_plan_counts_a_block_as_vllm_does(windowed, monkeypatch):
    """vLLM sizes a hybrid model's KV cache by its largest group's pages: here two of the
    four layers' (`drafting.kv_bytes_per_block`). The engine then has exactly the blocks
    TriForce planned, and its summaries are for the two full-attention layers; counting
    all four layers' pages planned half the blocks vLLM made."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cache = 64 * 2**20
    _, stats, (plan, pages, num_blocks, reserved) = generate(
        windowed, fixed_depth_spec(budget=256), kv_cache_memory_bytes=cache,
        read=lambda d: (d.memory_plan(),
                        sum(s.page_size_bytes for s in d._kv_cache_specs().values()),
                        d.summaries.num_blocks, d.reserved_bytes))
    assert_drafted(stats)
    assert num_blocks == plan.blocks_for(cache)
    assert reserved == cache - num_blocks * plan.kv_bytes_per_block
    assert plan.kv_bytes_per_block * 2 == pages


def test_three_levels_or_model_runner_v2_with_window_layers_refused(windowed, tmp_path,
                                                                   monkeypatch):
    """Refused when vLLM builds the config, with the fix: a small draft beside a target
    with local layers (vLLM would group the draft's layers with the target's),
    and the Model Runner V2 binding (one table for every layer)."""
    from vllm.engine.arg_utils import EngineArgs

    draft = tiny_models.build_tiny_llama_draft(tmp_path / "draft")
    with pytest.raises(TriForceConfigError, match=r"a small draft model .* beside a target "
                                                  r"with local layers.*Fix: leave "):
        EngineArgs(model=str(windowed), max_model_len=1024,
                   speculative_config={**fixed_depth_spec(256), "model": str(draft)}
                   ).create_engine_config()
    monkeypatch.setenv("VLLM_TRIFORCE_MRV2", "1")
    from vllm_triforce import engine_settings

    with pytest.raises(TriForceConfigError, match=r"VLLM_TRIFORCE_MRV2=1 for a model with "
                                                  r"local layers"):
        engine_settings.check_windows(
            EngineArgs(model=str(windowed), max_model_len=1024).create_model_config(), None)
