"""`method: triforce` inside vLLM: exact greedy identity with plain vLLM, and the plumbing.

Prompts are longer than the retrieval budget and than the tiny draft's
max_position_embeddings (256), so every level runs sparse and the draft re-bases.
"""

import gc

import pytest

import tiny_models
from engine_helpers import (assert_drafted, drafter_of, force_depths, free_llm, in_process_llm,
                            make_engine_kwargs, record_rerank_calls)
from vllm_triforce.config import FULL_KEY_POLICIES

pytestmark = pytest.mark.engine

PROMPT_WORDS = (30, 260, 520, 140)  # ~1.5 tokens per word: 45 .. 800 tokens
MAX_TOKENS = (24, 40, 32, 48)       # requests finish at different steps
# blocks (of 32 tokens) a request's decode can complete: at most 48 tokens touch 3 blocks;
# its prompt's blocks are folded as the prefill computes them (~1,700 tokens, ~50 blocks)
DECODE_BLOCKS = 3 * len(PROMPT_WORDS)


def prompts():
    return [tiny_models.make_text(n, seed=i) for i, n in enumerate(PROMPT_WORDS)]


def greedy_params():
    from vllm import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]


def generate(model, spec=None, schedule=None, on_engine=None, **over):
    """`schedule`: depths the controller must use in turn (engine_helpers.force_depths);
    `on_engine`: called with the engine before it generates (after the schedule is set)."""
    kwargs = make_engine_kwargs(**over)
    llm = in_process_llm(model, spec, disable_log_stats=spec is None, **kwargs)
    if schedule is not None:
        force_depths(llm, schedule)
    if on_engine is not None:
        on_engine(llm)
    try:
        outs = llm.generate(prompts(), greedy_params(), use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        stats = drafter_of(llm).stats.snapshot() if spec else None
        metrics = spec_metrics(llm) if spec else None
    finally:
        free_llm(llm)
    return tokens, stats, metrics


def spec_metrics(llm) -> dict:
    return {m.name: getattr(m, "value", None) for m in llm.get_metrics()
            if m.name.startswith(("vllm:spec_decode", "vllm:triforce"))}


_PLAIN: dict = {}


def plain(model):
    if model not in _PLAIN:
        _PLAIN[model] = generate(model)[0]
    return _PLAIN[model]


def two_level(policy="retrieval", **extra):
    """Fixed depth (adaptive off) unless asked: the counters these tests compare are then
    deterministic. The controller's tests below turn it on."""
    return {"method": "triforce", "num_speculative_tokens": 4, "retrieval_budget": 160,
            "retrieval_sink_tokens": 16, "retrieval_recent_tokens": 32,
            "selection_policy": policy, "refresh_interval": 16, "adaptive": False,
            "allow_full_key_copy": policy in FULL_KEY_POLICIES, **extra}


def three_level(draft, policy="retrieval", **extra):
    return two_level(policy, model=str(draft), draft_window_tokens=96,
                     draft_tokens_per_round=2, **extra)


@pytest.mark.parametrize("policy", ["retrieval", "streamingllm", "h2o", "topk_oracle", "quest"])
def test_two_level_greedy_identical_mha(tiny_llama, policy):
    tokens, stats, _ = generate(tiny_llama, two_level(policy))
    assert tokens == plain(tiny_llama)
    assert_drafted(stats)
    assert stats["refreshes"] > len(PROMPT_WORDS)


def test_rerank_runs_its_exact_stage_and_stays_identical(tiny_llama, monkeypatch):
    """rerank's second stage runs, reading keys from vLLM's KV cache (no key copy); the
    cache reader passed its check against the captured keys before it was used."""
    from vllm_triforce.engine.paged_keys import PagedKeys

    calls = record_rerank_calls(monkeypatch)
    tokens, stats, _ = generate(tiny_llama, two_level("rerank"))
    assert tokens == plain(tiny_llama)
    assert_drafted(stats)
    assert calls and {args[0].factor for args in calls} == {4}
    assert all(isinstance(args[3], PagedKeys) and args[3].checked for args in calls)
    assert stats["refreshes"] > len(PROMPT_WORDS)


def test_rerank_drops_a_cache_reader_that_fails_its_check(tiny_llama, monkeypatch):
    """A reader whose keys differ from the captured ones is never used: rerank keeps its
    first stage (rerank_exactly is handed no key source) and outputs stay identical."""
    from vllm_triforce.engine import paged_keys

    calls = record_rerank_calls(monkeypatch)
    monkeypatch.setattr(paged_keys.PagedKeys, "check", lambda *args: "forced mismatch")
    tokens, stats, _ = generate(tiny_llama, two_level("rerank"))
    assert tokens == plain(tiny_llama)
    assert_drafted(stats)
    assert calls and {args[3] for args in calls} == {None}
    assert stats["refreshes"] > len(PROMPT_WORDS)


@pytest.mark.parametrize("policy", ["retrieval", "topk_oracle"])
def test_three_level_greedy_identical_gqa(tiny_qwen2, tiny_draft, policy):
    tokens, stats, _ = generate(tiny_qwen2, three_level(tiny_draft, policy))
    assert tokens == plain(tiny_qwen2)
    assert_drafted(stats, levels=3)
    assert stats["draft_rebases"] > 0  # prompts exceed the draft's 256 positions


def test_three_level_greedy_identical_mha(tiny_llama, tiny_draft):
    tokens, stats, _ = generate(tiny_llama, three_level(tiny_draft, "h2o"))
    assert tokens == plain(tiny_llama)
    assert_drafted(stats, levels=3)


def test_two_level_greedy_identical_gqa(tiny_qwen2):
    tokens, stats, _ = generate(tiny_qwen2, two_level("streamingllm"))
    assert tokens == plain(tiny_qwen2)
    assert_drafted(stats)


def test_full_budget_middle_level_is_the_target(tiny_qwen2):
    """With a budget above every context, level 2 attends to everything: it must equal the
    target exactly, so vLLM accepts every draft. Proves the per-layer tables, slots,
    positions and causal layout of the retrieval pass."""
    tokens, stats, metrics = generate(tiny_qwen2, two_level(retrieval_budget=4096))
    assert tokens == plain(tiny_qwen2)
    assert_drafted(stats)
    assert stats["top_accepted"] == stats["top_proposed"]
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == \
        metrics["vllm:spec_decode_num_draft_tokens"]


def test_self_draft_full_window_accepts_everything(tiny_llama):
    """The target as its own small draft with a window covering the whole context: level 1
    equals level 2 equals level 3, so every level accepts 100% (draft-level plumbing)."""
    spec = two_level(retrieval_budget=4096, model=str(tiny_llama), draft_window_tokens=2048,
                     draft_tokens_per_round=3)
    tokens, stats, _ = generate(tiny_llama, spec, max_model_len=1024)
    assert tokens == plain(tiny_llama)
    assert_drafted(stats, levels=3)
    assert stats["middle_accepted"] == stats["middle_proposed"]
    assert stats["top_accepted"] == stats["top_proposed"]


def test_preemption_and_prefix_sharing_stay_identical(tiny_llama):
    """A KV cache too small for the batch forces preemption and recompute; shared prompt
    prefixes hit the prefix cache. Output must not change."""
    tokens, stats, _ = generate(tiny_llama, two_level(), num_gpu_blocks_override=48,
                                max_num_seqs=4)
    assert tokens == plain(tiny_llama)
    assert_drafted(stats)


# ---- block summaries, lazily (engine/summary_keeper.py) ----------------------------------
def shadow_eager_summaries(monkeypatch) -> list[int]:
    """Keep, beside the engine's summaries, the ones eager folding would hold (every
    committed token's captured key, every step), and check at every selection that the
    engine's summaries of the blocks it scores -- its requests' full committed blocks --
    equal them (coded summaries, the default: within two codings of them, as a block two
    prompt chunks share is coded twice). Returns the number of blocks compared per
    selected request."""
    import torch

    from vllm_triforce.core.selection import Selector
    from vllm_triforce.core.summaries import BlockSummaries
    from vllm_triforce.engine import summary_keeper

    shadows, compared = {}, []
    fold = summary_keeper.SummaryKeeper.fold
    choose = Selector.choose

    def fold_and_shadow(self, batch, states, prefills):
        s = self.summaries
        if id(s) not in shadows:
            shadows[id(s)] = BlockSummaries(
                s.num_layers, s.num_blocks, s.num_kv_heads, s.head_dim, s.block_size,
                keep_bounds=s.mins is not None, keep_variance=s.square_deviations is not None,
                compact_variance=s.channel_profile is not None)  # never coded: exact
        if self.capture.keys[0] is not None:
            for committed in self.committed_tokens(batch, range(batch.num_reqs)):
                summary_keeper.fold_committed(shadows[id(s)], self.capture.keys, committed)
        return fold(self, batch, states, prefills)

    def compare_then_choose(self, queries, summaries, block_tables, committed, *args, **kw):
        eager = shadows[id(summaries)]
        for table, n in zip(block_tables, committed.tolist()):
            ids = table[:n // summaries.block_size].long()
            assert torch.equal(summaries.counts[ids], eager.counts[ids])
            for store in ("sums", "square_deviations", "mins", "maxs"):
                if getattr(eager, store) is not None:
                    assert_store_close(getattr(summaries, store), getattr(eager, store), ids,
                                       store)
            compared.append(ids.numel())
        return choose(self, queries, summaries, block_tables, committed, *args, **kw)

    monkeypatch.setattr(summary_keeper.SummaryKeeper, "fold", fold_and_shadow)
    monkeypatch.setattr(Selector, "choose", compare_then_choose)
    return compared


def assert_store_close(store, exact, ids, name: str) -> None:
    """A summary store's blocks `ids` against an uncoded store's `exact` values: within
    1e-4, or, coded, within two codings (core/summary_coding.py): fp8 sums within 1/8 of
    their row's largest magnitude, log-coded deviations within 5% of each value (or 2^-15
    of the row's largest)."""
    import torch

    from vllm_triforce.core.summary_coding import CodedStore

    want = exact[:, ids].float()
    if not isinstance(store, CodedStore):
        assert torch.allclose(store[:, ids].float(), want, rtol=1e-4, atol=1e-4), name
        return
    got, top = store.gather(ids), want.abs().amax(-1, keepdim=True)
    if store.coding == "fp8":
        assert ((got - want).abs() <= top / 8 + 1e-4).all(), name
    else:
        assert ((got - want).abs() <= 0.05 * want + top * 2**-15 + 1e-6).all(), name


@pytest.mark.parametrize("policy, prefix_caching, chunk", [
    ("retrieval", False, None), ("quest", True, None), ("retrieval", False, 200)])
def test_lazy_summaries_equal_the_eager_ones(tiny_llama, monkeypatch, policy, prefix_caching,
                                             chunk):
    """Every selection reads summaries equal to the ones folding every committed key at
    every step gives, although only prefill passes folded keys and the blocks completed
    while decoding were set from the KV cache just before a selection (no prompt read
    back: at most DECODE_BLOCKS were). A cache too small for the batch preempts requests:
    without prefix caching a recomputed request gets new physical blocks; with it, shared
    prefixes. Chunks of 200 tokens end inside blocks of 32: a block two chunks share is
    complete only after the second."""
    compared = shadow_eager_summaries(monkeypatch)
    keepers = []
    over = {} if chunk is None else {"max_num_batched_tokens": chunk}
    tokens, stats, _ = generate(tiny_llama, two_level(policy), num_gpu_blocks_override=48,
                                max_num_seqs=4, enable_prefix_caching=prefix_caching,
                                on_engine=lambda llm: keepers.append(
                                    drafter_of(llm).retrieval.keeper), **over)
    assert tokens == plain(tiny_llama)
    assert_drafted(stats)
    assert keepers[0].lazy and 0 < stats["summarised_blocks"] <= DECODE_BLOCKS
    assert len(compared) >= stats["refreshes"] > 0 and sum(compared) > 0


def test_a_prefix_cache_hit_reuses_the_summaries(tiny_llama, monkeypatch):
    """The same prompts again, on one engine: their blocks hit the prefix cache, and the
    summaries the first requests' prefills folded there are not set again (same content,
    same physical block: the second requests set at most what their own decode
    completed); what the second requests' selections read still equals the eager fold."""
    compared = shadow_eager_summaries(monkeypatch)
    llm = in_process_llm(tiny_llama, two_level(), **make_engine_kwargs(enable_prefix_caching=True))
    try:
        stats = drafter_of(llm).stats
        runs, summarised = [], []
        for _ in range(2):
            before = stats.summarised_blocks
            outs = llm.generate(prompts(), greedy_params(), use_tqdm=False)
            runs.append([list(o.outputs[0].token_ids) for o in outs])
            summarised.append(stats.summarised_blocks - before)
        snapshot = stats.snapshot()
    finally:
        free_llm(llm)
    assert runs[0] == runs[1] == plain(tiny_llama)
    assert_drafted(snapshot)
    assert 0 < summarised[0] <= DECODE_BLOCKS and 0 < summarised[1] <= DECODE_BLOCKS, summarised
    assert compared


@pytest.mark.parametrize("ahead", [True, False], ids=["plan-ahead", "after-the-pass"])
def test_plain_steps_leave_the_summaries_untouched(tiny_llama, monkeypatch, ahead):
    """Forced plain: the engine decided at its first commit to fold prefills only, and no
    decode step touched a summary (no per-layer TriForce work on a plain step): the
    summaries after the last pass with a prompt chunk are those at the end, and nothing was
    set from the cache. With the controller asked during vLLM's pass (`plan_ahead`, the
    default) its depth-0 decode steps are host plain steps (engine/plain_steps.py) and
    never reach the commit; planned after the pass, each one commits, and folds nothing."""
    import torch

    from vllm_triforce.core.reads import block_slice
    from vllm_triforce.engine import summary_keeper

    fold = summary_keeper.SummaryKeeper.fold
    after_prefill, decode_steps = [], []

    def fold_and_copy(self, batch, states, prefills):
        fold(self, batch, states, prefills)
        if max(batch.q_lens) > 1:
            after_prefill[:] = [block_slice(self.summaries.sums, slice(None)).clone(),
                                self.summaries.counts.clone()]
            decode_steps.clear()
        else:
            decode_steps.append(batch.num_reqs)

    monkeypatch.setattr(summary_keeper.SummaryKeeper, "fold", fold_and_copy)
    keepers = []

    def on_engine(llm):
        keepers.append(drafter_of(llm).retrieval.keeper)
        drafter_of(llm).plan_ahead = ahead

    tokens, stats, _ = generate(tiny_llama, two_level(adaptive=True), schedule=[0],
                                on_engine=on_engine)
    assert tokens == plain(tiny_llama)
    assert stats["plain_steps"] > 0 and stats["top_proposed"] == 0
    summaries = keepers[0].summaries
    assert keepers[0].lazy and keepers[0].status.startswith("checked")
    assert stats["summarised_blocks"] == 0
    sums, counts = after_prefill
    decode_commits, host_plain = len(decode_steps), stats["host_plain_steps"]
    if ahead:
        assert host_plain >= min(MAX_TOKENS) - 1, (decode_commits, host_plain)
    else:
        assert decode_commits >= min(MAX_TOKENS) - 1 and host_plain == 0
    assert counts.any()
    assert torch.equal(summaries.counts, counts)
    assert torch.equal(block_slice(summaries.sums, slice(None)), sums)


def test_token_pieces_cut_spans_at_the_limit():
    from vllm_triforce.core.summaries import token_pieces

    assert list(token_pieces([(0, 6, 3), (1, 0, 2)], 4)) == [[(0, 6, 3), (1, 0, 1)],
                                                             [(1, 1, 1)]]
    assert list(token_pieces([(0, 0, 9)], 4)) == [[(0, 0, 4)], [(0, 4, 4)], [(0, 8, 1)]]
    assert list(token_pieces([(2, 5, 4)], 4)) == [[(2, 5, 4)]]
    assert list(token_pieces([], 4)) == []


def test_token_pieces_cut_a_span_only_where_a_block_ends():
    from vllm_triforce.core.summaries import token_pieces

    # the docstring's example: request 1's block 0 does not fit the first piece's room
    assert list(token_pieces([(0, 6, 3), (1, 0, 9)], 6, block_size=4)) == [
        [(0, 6, 3)], [(1, 0, 4)], [(1, 4, 5)]]
    # a span from mid-block: its first cut where that block ends, then whole blocks
    assert list(token_pieces([(0, 2, 14)], 9, block_size=4)) == [
        [(0, 2, 6)], [(0, 8, 8)]]
    # a limit below a block: cut anywhere, as without blocks
    assert list(token_pieces([(0, 0, 5)], 2, block_size=4)) == [
        [(0, 0, 2)], [(0, 2, 2)], [(0, 4, 1)]]
    for limit in range(4, 20):  # never a block of one span in two pieces, never over limit
        pieces = list(token_pieces([(0, 3, 30), (1, 0, 17), (2, 9, 2)], limit, 4))
        assert all(sum(n for _, _, n in p) <= limit for p in pieces)
        seen = [(o, b) for p in pieces for o, first, n in p
                for b in {q // 4 for q in range(first, first + n)}]
        assert len(seen) == len(set(seen)), (limit, pieces)
        assert [q for p in pieces for o, f, n in p for q in range(f, f + n) if o == 0] == \
            list(range(3, 33))


def test_metrics_beside_spec_decode(tiny_llama):
    """Per-level TriForce counters appear in LLM.get_metrics() next to vllm:spec_decode_*."""
    _, stats, metrics = generate(tiny_llama, two_level())
    assert_drafted(stats)
    for name in ("top_proposed", "top_accepted", "middle_rounds", "refreshes"):
        assert metrics[f"vllm:triforce_{name}"] >= stats[name] > 0
    # our count of full-cache verifications is vLLM's own (prompt chunks are not counted)
    assert stats["top_proposed"] == metrics["vllm:spec_decode_num_draft_tokens"]
    assert stats["top_accepted"] == metrics["vllm:spec_decode_num_accepted_tokens"]


def test_live_requests_gauge_drops_when_the_engine_is_freed(tiny_llama):
    """The live-requests gauge counts state held by a running engine; once the engine is
    freed its gauge reads 0 (counters stay cumulative). Read per engine: engines of
    earlier tests may still be collected (and retire their own gauges) meanwhile."""
    import json

    from vllm_triforce import metrics as triforce_metrics

    def published(source):
        return json.loads((triforce_metrics.metrics_dir() / f"{source}.json").read_text())

    llm = in_process_llm(tiny_llama, two_level(), disable_log_stats=False, **make_engine_kwargs())
    try:
        llm.generate(prompts(), greedy_params(), use_tqdm=False)
        publisher = drafter_of(llm)._metrics
        publisher.flush()  # written at most every PUBLISH_INTERVAL_S: the latest, now
        source = publisher.source_id
        live, proposed = published(source)["live_requests"], published(source)["top_proposed"]
        exported = spec_metrics(llm)["vllm:triforce_live_requests"]
    finally:
        free_llm(llm)
        del llm
        gc.collect()
    assert live >= 1  # the last request's state goes at the engine's next step
    assert exported >= live  # /metrics and get_metrics() sum every live engine's gauge
    assert published(source)["live_requests"] == 0
    assert published(source)["top_proposed"] == proposed > 0


@pytest.mark.network
def test_smollm2_two_level_moby_dick(smollm2):
    """A real model on a long book prompt: identical greedy output with the depth controller
    and at a fixed depth, both having drafted (the controller's start-up probes draft at
    full depth); the fixed depth's acceptance printed and checked (the controller drafts
    only when it pays, so its acceptance says nothing about the retrieval cache)."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_triforce.assets import moby_dick_text

    ids = AutoTokenizer.from_pretrained(str(smollm2))(moby_dick_text()[:40000])["input_ids"]
    prompts = [{"prompt_token_ids": ids[:1200]}, {"prompt_token_ids": ids[3000:3800]}]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    spec = {"method": "triforce", "num_speculative_tokens": 4, "retrieval_budget": 256}
    results = []
    for speculative_config in (None, spec, {**spec, "adaptive": False}):
        llm = in_process_llm(smollm2, speculative_config, **make_engine_kwargs(max_model_len=4096))
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            stats = drafter_of(llm).stats.snapshot() if speculative_config else None
        finally:
            free_llm(llm)
        results.append(([list(o.outputs[0].token_ids) for o in outs], stats))
    (plain_tokens, _), (adaptive_tokens, adaptive), (fixed_tokens, stats) = results
    assert_drafted(adaptive)
    assert_drafted(stats)
    accepted, proposed = stats["top_accepted"], stats["top_proposed"]
    print(f"SmolLM2 two-level, 1200/800-token Moby-Dick prompts, depth 4: full-cache "
          f"acceptance of middle-level drafts {accepted}/{proposed} = {accepted / proposed:.3f}; "
          f"the controller drafted {adaptive['top_proposed']} tokens "
          f"({adaptive['plain_steps']} plain steps of "
          f"{adaptive['plain_steps'] + adaptive['drafting_steps']})")
    assert adaptive_tokens == plain_tokens and fixed_tokens == plain_tokens
    assert accepted / proposed > 0.3  # a real model drafts for itself well


def test_two_level_refreshes_when_full_cache_acceptance_drops(tiny_llama):
    """Two levels: the full-cache verification judges the retrieval cache, so its rolling
    acceptance triggers re-selection (stride off here). Threshold 0: only the first
    selection per request."""
    tokens, stats, _ = generate(tiny_llama, two_level(refresh_interval=0,
                                                      refresh_acceptance_threshold=1.0))
    assert tokens == plain(tiny_llama)
    assert_drafted(stats)
    _, quiet, _ = generate(tiny_llama, two_level(refresh_interval=0,
                                                 refresh_acceptance_threshold=0.0))
    assert quiet["refreshes"] == len(PROMPT_WORDS)
    assert stats["refreshes"] > len(PROMPT_WORDS)


def test_refresh_every_token_reselects_between_middle_rounds(tiny_llama):
    """refresh_interval 1 (the default): besides the selection at each step's start, every
    middle round after the first re-selects with the newest middle token's query -- with a
    fixed depth of 4 and one token per round, a selection per drafted token (at step starts
    only it would be one per 4). Outputs stay identical."""
    tokens, stats, _ = generate(tiny_llama, two_level(refresh_interval=1))
    assert tokens == plain(tiny_llama)
    assert_drafted(stats)
    assert stats["refreshes"] >= 0.9 * stats["top_proposed"], stats


@pytest.mark.parametrize("factor", [4, 0])
def test_middle_rounds_rerank_the_step_start_shortlist(tiny_llama, monkeypatch, factor):
    """Between middle rounds only each layer's best middle_shortlist x (retrieved blocks)
    candidates of the step's start are re-scored (budget 160 = 5 blocks: 1 sink, 1 recent,
    the tail, 2 retrieved -> 8 listed); 0 re-scores every candidate. Outputs identical."""
    from vllm_triforce.core import selection

    listed = []
    real = selection.select_listed

    def counting(scores, shortlist, blocks):
        listed.append(tuple(shortlist.logical.shape))
        return real(scores, shortlist, blocks)

    monkeypatch.setattr(selection, "select_listed", counting)
    tokens, stats, _ = generate(tiny_llama, two_level(refresh_interval=1,
                                                      middle_shortlist=factor))
    assert tokens == plain(tiny_llama)
    assert_drafted(stats)
    assert stats["refreshes"] >= 0.9 * stats["top_proposed"], stats
    if factor:  # every middle re-selection (3 of a step's 4 rounds) used the shortlist
        assert len(listed) >= stats["middle_rounds"] // 2 > 0
        assert {shape[1:] for shape in listed} == {(2, 8)}  # tiny_llama: 2 layers
    else:
        assert not listed


@pytest.mark.parametrize("variance", ["coded", "per channel", "compact", None])
def test_key_variance_is_the_default_and_can_be_turned_off(tiny_llama, monkeypatch, variance):
    """By default `retrieval` scores blocks by mean key + key variance (the squared-key
    sums, one per channel of tiny_llama's 32, are read at every selection), in float32 on a
    CPU (`compact_summaries` left out) and coded in one byte a value with
    `compact_summaries: true` (a GPU's default); compact_key_variance keeps 8 bands of
    them; key_variance false reads none. Outputs identical."""
    from vllm_triforce.core.summaries import BlockSummaries
    from vllm_triforce.core.summary_coding import CodedStore

    read = []
    real = BlockSummaries.deviations
    monkeypatch.setattr(BlockSummaries, "deviations",
                        lambda self: read.append(real(self)) or real(self))
    spec = two_level(refresh_interval=1)
    if variance is None:
        spec["key_variance"] = False
    if variance == "coded":
        spec["compact_summaries"] = True
    if variance == "compact":
        spec["compact_key_variance"] = True
    tokens, stats, _ = generate(tiny_llama, spec)
    assert tokens == plain(tiny_llama)
    assert_drafted(stats)
    assert stats["refreshes"] > 0
    assert {d.shape[-1] for d in read} == {"coded": {32}, "per channel": {32}, "compact": {8},
                                           None: set()}[variance]
    assert {isinstance(d, CodedStore) for d in read} == (
        {variance == "coded"} if variance else set())


# ---- the depth controller (core/controller.py, engine/depth.py) --------------------------
SCHEDULE = [3, 0, 4, 1, 0, 2]  # depths in turn, plain steps among them


def count_samplers(calls: dict):
    """An `on_engine` hook: counts the runner's calls of vLLM's plain sampler and of its
    rejection sampler into calls["plain"], calls["rejection"]."""
    def hook(llm):
        runner = drafter_of(llm).runner
        for key, sampler in (("plain", runner.sampler), ("rejection", runner.rejection_sampler)):
            calls[key] = 0
            forward = sampler.forward

            def counted(*args, _key=key, _forward=forward, **kwargs):
                calls[_key] += 1
                return _forward(*args, **kwargs)

            sampler.forward = counted
    return hook


def test_varying_depth_two_level_greedy_identical(tiny_llama):
    """Depth changes from step to step (0 included): vLLM's variable-length draft path. A
    step in which no request was handed a draft runs vLLM's plain sampler
    (patches/zero_draft.py); a step verifying drafts its rejection sampler."""
    calls = {}
    tokens, stats, metrics = generate(tiny_llama, two_level(adaptive=True), schedule=SCHEDULE,
                                      on_engine=count_samplers(calls))
    assert tokens == plain(tiny_llama)
    used = {k for k, n in enumerate(stats["depth_counts"]) if n}
    assert {0, 1, 2, 3, 4} <= used and stats["plain_steps"] > 0
    assert_drafted(stats)
    assert stats["top_proposed"] == metrics["vllm:spec_decode_num_draft_tokens"]
    assert 0 < calls["rejection"] <= stats["drafting_steps"]
    assert calls["plain"] > 0, "no step without drafts took vLLM's plain sampling path"


def test_varying_depth_three_level_greedy_identical(tiny_qwen2, tiny_draft):
    tokens, stats, _ = generate(tiny_qwen2, three_level(tiny_draft, adaptive=True),
                                schedule=SCHEDULE)
    assert tokens == plain(tiny_qwen2)
    assert_drafted(stats, levels=3)
    assert stats["plain_steps"] > 0


def test_three_level_steps_without_the_small_draft_stay_identical(tiny_qwen2, tiny_draft,
                                                                   monkeypatch):
    """Three levels in the controller's other middle mode (RETRIEVAL: the small draft sits
    out, the retrieval level drafts alone, one token per round) on every other plan, the
    small draft proposing on the rest: otherwise only the controller's start-up probe runs
    this mode. Switched in the controller's own Plans (scheduled: `schedule_depths`), so
    the engine's mapping of a mode to `use_draft` is what runs; every round records whether
    the small draft proposed."""
    import dataclasses
    import itertools

    from vllm_triforce.core import controller
    from vllm_triforce.engine.depth import DepthStep

    finish_round = DepthStep.round_done
    small_draft_ran = []  # per middle round: did the small draft propose in it

    def every_other_plan_retrieval_only(llm):
        ctl = drafter_of(llm).depth.controller
        decide, count = ctl.plan, itertools.count()  # the schedule's plans

        def plan(req_ids, max_depth, limits=None):
            chosen = decide(req_ids, max_depth, limits)
            if chosen.mode == controller.DRAFT and next(count) % 2:
                chosen = dataclasses.replace(chosen, mode=controller.RETRIEVAL)
            return chosen

        ctl.plan = plan

    def recording(self, use_draft, *args):
        small_draft_ran.append(use_draft)
        return finish_round(self, use_draft, *args)

    monkeypatch.setattr(DepthStep, "round_done", recording)
    tokens, stats, _ = generate(tiny_qwen2, three_level(tiny_draft, adaptive=True),
                                schedule=[4], on_engine=every_other_plan_retrieval_only)
    assert tokens == plain(tiny_qwen2)
    assert_drafted(stats, levels=3)
    assert small_draft_ran.count(False) > 0, "no middle round ran without the small draft"
    assert small_draft_ran.count(True) > 0


def test_requests_that_reach_max_model_len_stay_identical(tiny_llama):
    """Requests decode until max_model_len (no max_tokens) while drafting 6 a step: the last
    steps' drafts would run past the model's length, and vLLM's scheduler cuts them. Prompts
    1, 2, 5 and 40 tokens short of the limit, and one far from it."""
    import random

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    limit, rng = 512, random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, 500) for _ in range(n)])
               for n in (limit - 1, limit - 2, limit - 5, limit - 40, 300)]
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    outputs = {}
    for name, spec in (("plain", None), ("triforce", two_level(num_speculative_tokens=6,
                                                                retrieval_budget=128))):
        llm = in_process_llm(tiny_llama, spec, disable_log_stats=spec is None,
                             **make_engine_kwargs(max_model_len=limit))
        try:
            outputs[name] = [list(o.outputs[0].token_ids)
                             for o in llm.generate(prompts, params, use_tqdm=False)]
            stats = drafter_of(llm).stats.snapshot() if spec else None
        finally:
            free_llm(llm)
    assert [len(p["prompt_token_ids"]) + len(t) for p, t in zip(prompts, outputs["plain"])] \
        == [limit] * len(prompts)
    assert outputs["triforce"] == outputs["plain"]
    assert_drafted(stats)


def test_depth_zero_runs_no_middle_pass(tiny_llama):
    """Forced plain: no middle pass, and no step runs vLLM's rejection sampler (without
    patches/zero_draft.py every step did, with zero drafts)."""
    calls = {}
    tokens, stats, metrics = generate(tiny_llama, two_level(adaptive=True), schedule=[0],
                                      on_engine=count_samplers(calls))
    assert tokens == plain(tiny_llama)
    assert stats["middle_rounds"] == 0 and stats["top_proposed"] == 0
    assert stats["drafting_steps"] == 0 and stats["plain_steps"] > 0
    assert not metrics.get("vllm:spec_decode_num_draft_tokens")
    assert calls["rejection"] == 0 and calls["plain"] >= max(MAX_TOKENS)


def test_controller_decides_and_stays_identical(tiny_qwen2, tiny_draft):
    """The real controller (timing-driven, so its choices vary run to run): output is
    identical whatever it chooses, and its choices and rates are reported."""
    tokens, stats, metrics = generate(tiny_qwen2, three_level(tiny_draft, adaptive=True))
    assert tokens == plain(tiny_qwen2)
    assert sum(stats["depth_counts"]) >= stats["plain_steps"] + stats["drafting_steps"] > 0
    assert_drafted(stats, levels=3)  # start-up probes drafting in each mode at least once
    assert metrics["vllm:triforce_drafting_steps"] >= stats["drafting_steps"]


def test_dynamic_sd_table_caps_the_depth(tiny_llama):
    """vLLM's num_speculative_tokens_per_batch_size passes through; its k bounds each step."""
    spec = two_level(adaptive=True, num_speculative_tokens_per_batch_size=[[1, 256, 2]])
    tokens, stats, _ = generate(tiny_llama, spec, schedule=[4])
    assert tokens == plain(tiny_llama)
    assert_drafted(stats)
    assert len(stats["depth_counts"]) == 3 and stats["depth_counts"][2] > 0
