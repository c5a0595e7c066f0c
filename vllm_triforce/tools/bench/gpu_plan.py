"""The jobs of `vllm-triforce bench gpu` (bench/gpu_check.py), in the order they run, and the
settings each engine gets: what is measured, not how it is scheduled or reported.

Jobs, each one engine in its own process (bench/gpu_job.py), in order of what matters
first, so that a run cut short still answers the first questions:
1. `kernels`: vLLM's compiled kernels on this torch (stable ABI) against torch references
   (seconds; decides FLASH_ATTN or TRITON_ATTN for the rest).
2. costs at Llama-3.1-8B's shape (random weights, `load_format="dummy"`), cases 8 x 32K
   and 1 x 128K first: plain vLLM with its own defaults (MRV2, FULL_AND_PIECEWISE graphs,
   async scheduling: the reference every speedup is taken against), TriForce (memory
   against its reservation; ms per step at forced depths 0, 2, 4, 6), plain vLLM with
   TriForce's forced settings (the tax the plugin's settings put on a shared server's
   plain steps).
3. exactness (tiny random Llama target + draft): plain vLLM, TriForce two and three levels,
   greedy, drafting forced (`adaptive` false), on TRITON_ATTN in float32 (token identity)
   and FLASH_ATTN in bf16 (FlashAttention has no float32: a divergence must sit where
   plain vLLM's own top-2 log-prob margin is below MARGIN_EPS, bench/gpu_summary.py). Plain
   engines run with TriForce's forced settings (V1 runner, PIECEWISE graphs, synchronous
   scheduling), so the syncs per step compare like with like. Jobs `exact-*-mrv2` run the
   TriForce engines again in Model Runner V2 (`VLLM_TRIFORCE_MRV2=1`, experimental), against
   the same plain reference. Random weights accept almost
   nothing: acceptance under CUDA graphs is checked with a real model (`vllm-triforce demo`
   on a GPU, benchmarks/gpu/).
4. the sampled distribution (`sample-*`, `_sample_jobs`): 2,000 continuations of one prompt
   at temperature 1 on a 512-token vocabulary, TriForce's depths forced to vary, tokens
   2-4 against plain vLLM's by a chi-square test (bench/gpu_summary.py), on V1 and on
   Model Runner V2 (synchronous and async), each beside a negative control whose hand-off
   is wrong and must be caught.
5. where the tax goes (`tax-*`, `_tax_jobs`, GPU only): plain vLLM with its defaults,
   moved toward TriForce's settings one setting at a time, and with TriForce's, then a
   spec-decode engine's (1 + K)-token FULL step.

Estimates are the H100 run's (benchmarks/gpu/jobs.log): an eager tiny engine starts in
20-45 s; a compiled 8B engine (torch.compile, JIT warm-up, ~60 CUDA-graph sizes) in 60-120 s
cold, and each 256K-token case adds a prefill of ~20 s and its decodes.

Without CUDA (or with `--dry-run`) the same jobs run on tiny shapes with CPU_ATTN.
"""

from __future__ import annotations

FORCED_SETTINGS = {"env": {"VLLM_USE_V2_MODEL_RUNNER": "0"},
                   "llm": {"compilation_config": {"cudagraph_mode": "PIECEWISE"},
                           "async_scheduling": False}}
# TriForce in Model Runner V2 (experimental, engine/mrv2/): jobs `exact-*-mrv2`
MRV2_SETTINGS = {"env": {"VLLM_TRIFORCE_MRV2": "1"}}
TINY_SPEC = {"method": "triforce", "num_speculative_tokens": 4, "retrieval_budget": 256,
             "retrieval_sink_tokens": 32, "retrieval_recent_tokens": 64,
             "refresh_interval": 1, "adaptive": False}
COST_SPEC = {"method": "triforce", "num_speculative_tokens": 6, "retrieval_budget": 4096}
# (name, batch, context): 256K tokens of KV as 8 requests, one 128K request (TriForce's
# own case), then 32 and 64 requests (MagicDec's gains are at batch 32-256; at 64 every
# request drafts only if the drafting cap allows it), in that order.
GPU_CASES = (("8x32K", 8, 32768 - 512), ("1x128K", 1, 131072 - 1024), ("32x8K", 32, 8192 - 512),
             ("64x8K", 64, 8192 - 256))
GPU_DEPTHS = [0, 2, 4, 6]
# Both engines at vLLM's default: with `prefill_from_cache` (on by default on a GPU) a long
# prefill chunk holds no captured keys outside vLLM's profile run (engine/device/capture.py;
# until 2026-11-30 TriForce's ran at 0.85 to leave room for them).
GPU_MEMORY = {"plain": 0.9, "triforce": 0.9}
CPU_CASES = (("2x1K", 2, 1024), ("1x2K", 1, 2048))
# The KV cache given back (GPU only, job kv-kept, after the cost jobs): TriForce's engine with
# compact summaries and no prefill peak, at plain vLLM's gpu_memory_utilization; its block
# count against plain's at the same settings (job kv-plain), its propose peak against its
# reservation, at the 1 x 128K case (every prefill chunk at its longest) with drafting.
KV_KEPT_SPEC = {"prefill_from_cache": True}  # the GPU's default too, as the coded summaries
# Where the tax goes (GPU only, jobs `tax-*`, run by `gpu_session.sh tax`): plain vLLM at
# the 8B shape, from vLLM's defaults (Model Runner V2, FULL_AND_PIECEWISE, async) toward
# TriForce's settings (V1, PIECEWISE, synchronous) one setting at a time: async off, then
# PIECEWISE too; the V1 runner alone. Both ends run again in the same lease (`tax-defaults`,
# `tax-forced`: costs-plain-defaults and costs-plain-forced may be another card's), with
# the same CUDA graphs, cut to the decode batches (shorter starts; a step replays the graph
# of its own size either way). (name, V2 runner, mode, async), in the order they run.
TAX_SETTINGS = (("tax-defaults", "1", "FULL_AND_PIECEWISE", True),
                ("tax-v2-full-sync", "1", "FULL_AND_PIECEWISE", False),
                ("tax-v2-piecewise-sync", "1", "PIECEWISE", False),
                ("tax-v1-full-async", "0", "FULL_AND_PIECEWISE", True),
                ("tax-forced", "0", "PIECEWISE", False))
# ... and a spec-decode engine's step on vLLM's defaults: Model Runner V2's GPU n-gram
# drafter fills a slot it finds no match for with the last token and verifies it as a
# draft, so every step verifies 1 + K tokens per request on a FULL graph captured for
# exactly that (what depth 0 by filler drafts would cost); against costs-triforce-mrv2's
# depth 0 (1 token per request in a spec-decode engine) and plain vLLM's 1-token FULL step.
# n-grams of 48 never match in random prompts (the decode adds at most 40 tokens).
TAX_SPEC = {"method": "ngram_gpu", "num_speculative_tokens": COST_SPEC["num_speculative_tokens"],
            "prompt_lookup_min": 48, "prompt_lookup_max": 48}


# The sampled jobs (`_sample_jobs`), as tests/test_triforce_sampling.py checks V1 on a CPU:
# continuations per engine (fewer in a dry run, which tests the jobs, not the statistics),
# the depths the controller plans in turn, the retrieval budget (of the 391-token prompt's
# 13 blocks: both verification paths run), the negative control's temperature.
SAMPLE_COPIES = {"gpu": 2000, "cpu": 300}
SAMPLE_SCHEDULE = [3, 0, 2, 1]
SAMPLE_PROMPT_TOKENS = 391
SAMPLE_SPEC = {**TINY_SPEC, "adaptive": True, "retrieval_budget": 288}
WRONG_TEMPERATURE = 0.5


def plan(on_gpu: bool, models: dict, kernels_ok: bool = True) -> list[dict]:
    """The jobs, in the order they run. `models`: paths of "target", "draft", "shape",
    "sampling", "windowed" (a GPU's only)."""
    jobs = [{"name": "kernels", "kind": "kernels", "estimate_s": 20, "timeout_s": 120}]
    jobs.extend(_cost_jobs(on_gpu, models, kernels_ok))
    # eager engines: seconds to start (the cost jobs run the compiled default path)
    backends = ([("triton-fp32", "TRITON_ATTN", "float32")]
                + ([("flash-bf16", "FLASH_ATTN", "bfloat16")] if kernels_ok else [])
                if on_gpu else [("cpu-fp32", "CPU_ATTN", "float32")])
    prompts = _tiny_prompts(models["vocab"])
    for tag, backend, dtype in backends:
        llm = {"dtype": dtype, "enforce_eager": True, "block_size": 32, "seed": 0,
               "max_model_len": 4096, "attention_config": {"backend": backend},
               "gpu_memory_utilization": 0.3}
        if not on_gpu:
            llm.pop("gpu_memory_utilization")
        levels = ((2, 3) if on_gpu else (3,))
        base = {"kind": "generate", "model": str(models["target"]), "prompts": prompts,
                "model_tag": models["tag"],
                "max_tokens": 48, "estimate_s": 30, "timeout_s": 240}
        jobs.append({**base, "name": f"exact-{tag}-plain", "logprobs": 2,
                     "env": FORCED_SETTINGS["env"], "llm": {**llm, "async_scheduling": False}})
        for n in levels:
            spec = dict(TINY_SPEC, **({"model": str(models["draft"]),
                                       "draft_window_tokens": 96,
                                       "draft_tokens_per_round": 2} if n == 3 else {}))
            jobs.append({**base, "name": f"exact-{tag}-{n}L", "spec": spec, "llm": llm,
                         "levels": n, "reference": f"exact-{tag}-plain"})
        if on_gpu:  # the prompts' passes pass the capture's 512 copied tokens: kept compact
            jobs.append({**base, "name": f"exact-{tag}-fromcache",
                         "spec": {**TINY_SPEC, "prefill_from_cache": True}, "llm": llm,
                         "levels": 2, "reference": f"exact-{tag}-plain"})
            jobs.extend(_window_jobs(tag, base, llm, models))
            # the experimental Model Runner V2 binding (engine/mrv2/): the same engines
            # in vLLM's V2 runner, against the same plain V1 reference
            for n in levels:
                spec = next(j["spec"] for j in jobs if j["name"] == f"exact-{tag}-{n}L")
                jobs.append({**base, "name": f"exact-{tag}-{n}L-mrv2", "spec": spec,
                             "llm": llm, "env": MRV2_SETTINGS["env"], "levels": n,
                             "reference": f"exact-{tag}-plain"})
            jobs.extend(_grow_jobs(tag, base, llm, models["vocab"]))
        if tag != "flash-bf16":  # float32 only: one distribution, not bf16's roundings
            jobs.extend(_sample_jobs(tag, llm, models, on_gpu))
    if on_gpu:  # last: asked for by name (`gpu_session.sh tax`)
        jobs.extend(_tax_jobs(next(j for j in jobs if j["name"] == "costs-plain-defaults")))
    return jobs


def _window_jobs(tag: str, base: dict, llm: dict, models: dict) -> list[dict]:
    """A target with sliding-window layers beside full ones (`models["windowed"]`,
    bench/gpu_models.py `build_windowed_model`; vLLM gives each kind a KV-cache group):
    plain vLLM with TriForce's settings, then TriForce's two levels against it, whose
    passes run the window layers over their own group (engine/device/forward.py
    `WindowLayers`); then again with `round_graphs`, the window layers' tables, slots and
    true lengths in the round buffers (engine/device/round_graph.py `WindowGroup`)."""
    from vllm_triforce.tools.bench.gpu_models import WINDOW_TAG

    window = {**base, "model": str(models["windowed"]), "model_tag": WINDOW_TAG}
    return [{**window, "name": f"exact-{tag}-window-plain", "logprobs": 2,
             "env": FORCED_SETTINGS["env"], "llm": {**llm, "async_scheduling": False}},
            {**window, "name": f"exact-{tag}-window-2L", "spec": TINY_SPEC, "llm": llm,
             "levels": 2, "reference": f"exact-{tag}-window-plain"},
            {**window, "name": f"exact-{tag}-window-2L-graphs",
             "spec": {**TINY_SPEC, "round_graphs": True}, "llm": llm, "levels": 2,
             "reference": f"exact-{tag}-window-plain"}]


def _sample_jobs(tag: str, llm: dict, models: dict, on_gpu: bool) -> list[dict]:
    """Sampled output against the target distribution (bench/gpu_summary.py
    `_distribution`): plain vLLM, then TriForce (two levels, the depth controller planning
    SAMPLE_SCHEDULE in turn) on V1 and, on a GPU, on Model Runner V2 with synchronous and
    async scheduling; each TriForce binding also as its negative control (`-wrong`: the
    verifier handed distributions other than the drafts were drawn from); and on V1 with
    `compiled_sampling` (`-compiled`: the middle level's draws compiled). A different
    engine seed each, so no two draw from one random stream."""
    from vllm_triforce.tools.bench.gpu_engine import random_prompts
    from vllm_triforce.tools.bench.gpu_models import SAMPLING_TAG, SAMPLING_VOCAB

    prompt = random_prompts(1, SAMPLE_PROMPT_TOKENS, SAMPLING_VOCAB, seed=7)
    llm = {**llm, "max_model_len": 1024, "max_num_seqs": 32}
    base = {"kind": "generate", "model": str(models["sampling"]), "prompts": prompt,
            "model_tag": SAMPLING_TAG, "max_tokens": 4, "estimate_s": 40, "timeout_s": 300,
            "sampling": {"temperature": 1.0,
                         "copies": SAMPLE_COPIES["gpu" if on_gpu else "cpu"]}}
    tri = {**base, "spec": SAMPLE_SPEC, "levels": 2, "depth_schedule": SAMPLE_SCHEDULE,
           "reference": f"sample-{tag}-plain"}
    wrong = {"wrong_temperature": WRONG_TEMPERATURE}
    plain = {**base, "name": f"sample-{tag}-plain", "env": FORCED_SETTINGS["env"],
             "llm": {**llm, "seed": 0, "async_scheduling": False}}
    v1 = {**tri, "name": f"sample-{tag}-2L", "llm": {**llm, "seed": 1}}
    if not on_gpu:
        return [plain, v1]
    # MRV2 first: V1's sampling is also checked on every CPU (tests/test_triforce_sampling.py)
    mrv2 = {**tri, "env": MRV2_SETTINGS["env"]}
    return [
        plain,
        {**mrv2, "name": f"sample-{tag}-2L-mrv2", "llm": {**llm, "seed": 3}},
        {**mrv2, **wrong, "name": f"sample-{tag}-2L-mrv2-wrong", "llm": {**llm, "seed": 4}},
        {**mrv2, "name": f"sample-{tag}-2L-mrv2-async",
         "llm": {**llm, "seed": 5, "async_scheduling": True}},
        v1,
        {**tri, **wrong, "name": f"sample-{tag}-2L-wrong", "llm": {**llm, "seed": 2}},
        # the draws compiled (`compiled_sampling`, off until a GPU has run it)
        {**tri, "name": f"sample-{tag}-2L-compiled", "llm": {**llm, "seed": 6},
         "spec": {**SAMPLE_SPEC, "compiled_sampling": True}},
    ]


def _grow_jobs(tag: str, base: dict, llm: dict, vocab: int) -> list[dict]:
    """Requests that start inside the retrieval budget and grow past it, under the depth
    controller: their first steps are plain steps found on the host (engine/plain_steps.py:
    no batch, no device read, on MRV2 no commit to the records), the later ones do work,
    and on MRV2 take the plain steps' tokens up from vLLM's token history
    (engine/mrv2/requests.py). Plain vLLM, TriForce on V1, TriForce on MRV2 with
    synchronous and with async scheduling."""
    from vllm_triforce.tools.bench.gpu_engine import random_prompts

    # 150-240 tokens, 120 new: every context fits the 256-token budget for the first steps
    prompts = [p[:150 + 30 * i] for i, p in enumerate(random_prompts(4, 240, vocab, seed=5))]
    grow = {**base, "prompts": prompts, "max_tokens": 120}
    spec = {**TINY_SPEC, "adaptive": True}
    jobs = [
        {**grow, "name": f"exact-{tag}-grow-plain", "logprobs": 2,
         "env": FORCED_SETTINGS["env"], "llm": {**llm, "async_scheduling": False}},
        {**grow, "name": f"exact-{tag}-grow-2L", "spec": spec, "llm": llm, "levels": 2,
         "reference": f"exact-{tag}-grow-plain"},
        {**grow, "name": f"exact-{tag}-grow-2L-mrv2", "spec": spec, "llm": llm,
         "env": MRV2_SETTINGS["env"], "levels": 2, "reference": f"exact-{tag}-grow-plain"},
        # explicit async scheduling, which MRV2 takes: K drafts scheduled for everyone, cut
        # to each request's depth by the runner (engine/mrv2/draft_tokens.py)
        {**grow, "name": f"exact-{tag}-grow-2L-mrv2-async", "spec": spec,
         "llm": {**llm, "async_scheduling": True}, "env": MRV2_SETTINGS["env"], "levels": 2,
         "reference": f"exact-{tag}-grow-plain"},
    ]
    if tag == "flash-bf16":  # compiled: vLLM's defaults against TriForce on them
        compiled = {**llm, "enforce_eager": False,
                    "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}}
        full = {**compiled, "async_scheduling": True,
                "compilation_config": {**compiled["compilation_config"],
                                       "cudagraph_mode": "FULL_AND_PIECEWISE"}}
        sizes = {"estimate_s": 90, "timeout_s": 300}
        jobs += [
            {**grow, **sizes, "name": f"exact-{tag}-grow-defaults-plain", "logprobs": 2,
             "llm": compiled},
            # FULL decode graphs where TriForce reads nothing of a pass, piecewise where it
            # does (engine/mrv2/graphs.py), with async scheduling: vLLM's defaults
            {**grow, **sizes, "name": f"exact-{tag}-grow-2L-mrv2-full", "spec": spec,
             "llm": full, "env": MRV2_SETTINGS["env"], "levels": 2,
             "reference": f"exact-{tag}-grow-defaults-plain"},
        ]
    return jobs


def _tiny_prompts(vocab: int) -> list[list[int]]:
    from vllm_triforce.tools.bench.gpu_engine import random_prompts

    # four prompts of 600-900 tokens: well past the retrieval budget (256) and the draft's
    # window (96), so both caches select and re-base
    return [p[:600 + 100 * i] for i, p in enumerate(random_prompts(4, 900, vocab, seed=3))]


def _cost_jobs(on_gpu: bool, models: dict, kernels_ok: bool) -> list[dict]:
    cases = [{"name": n, "batch": b, "context": c} for n, b, c in
             (GPU_CASES if on_gpu else CPU_CASES)]
    # plain engines hold at most the largest case's batch (fewer CUDA graphs to capture);
    # TriForce's holds 256 for the memory check (`many_requests`)
    plain_seqs = max(c["batch"] for c in cases)
    common = {"kind": "costs", "model": str(models["shape"]), "cases": cases,
              "prompt_vocab": models["vocab"],
              "decode_tokens": (8, 40) if on_gpu else (4, 12)}
    if on_gpu:
        llm = {"load_format": "dummy", "dtype": "bfloat16", "max_model_len": 131072,
               "seed": 0, "gpu_memory_utilization": GPU_MEMORY["plain"],
               "attention_config": {"backend": "FLASH_ATTN" if kernels_ok else "TRITON_ATTN"}}
        sizes = {"estimate_s": 110, "timeout_s": 420}
    else:
        llm = {"load_format": "dummy", "dtype": "float32", "max_model_len": 4096, "seed": 0,
               "enforce_eager": True, "block_size": 32}
        sizes = {"estimate_s": 40, "timeout_s": 300}
    # on CPU the contexts are short: a budget below them, or no request would draft (a
    # request whose context fits the retrieval cache decodes plainly)
    spec = COST_SPEC if on_gpu else {**COST_SPEC, "retrieval_budget": 256}
    tri_llm = {**llm, "max_num_seqs": 256 if on_gpu else 8}
    if on_gpu:
        tri_llm["gpu_memory_utilization"] = GPU_MEMORY["triforce"]
    triforce = {**common, **sizes, "name": "costs-triforce", "spec": spec,
                "depths": GPU_DEPTHS if on_gpu else [0, 2],
                "estimate_s": 150 if on_gpu else sizes["estimate_s"], "llm": tri_llm,
                "many_requests": {"num": 256, "context": 1024, "tokens": 8} if on_gpu else None}
    forced = {**common, **sizes, "name": "costs-plain-forced", "env": FORCED_SETTINGS["env"],
              "llm": {**llm, **FORCED_SETTINGS["llm"], "max_num_seqs": plain_seqs}}
    if not on_gpu:
        forced["llm"] = {**llm, "async_scheduling": False, "max_num_seqs": plain_seqs}
        return [triforce, forced]
    defaults = {**common, **sizes, "name": "costs-plain-defaults",
                "llm": {**llm, "max_num_seqs": plain_seqs}}
    kept = {**triforce, "name": "kv-kept", "spec": {**spec, **KV_KEPT_SPEC},
            "cases": [c for c in cases if c["name"] == "1x128K"], "depths": [0, 6],
            "llm": {**tri_llm, "gpu_memory_utilization": GPU_MEMORY["plain"]},
            "estimate_s": 90, "many_requests": None}
    # ... and plain vLLM's blocks at kv-kept's own settings: TriForce's forced settings and
    # its max_num_seqs (vLLM's profile and graphs grow with max_num_seqs, outside
    # TriForce's reservation: costs-plain-forced runs at the cases' largest batch)
    kept_plain = {**forced, "name": "kv-plain", "cases": kept["cases"], "estimate_s": 70,
                  "llm": {**forced["llm"], "max_num_seqs": tri_llm["max_num_seqs"],
                          "gpu_memory_utilization": GPU_MEMORY["plain"]}}
    # TriForce on vLLM's defaults (experimental): Model Runner V2, FULL decode graphs where
    # it reads nothing of a pass, async scheduling; depth 0 against costs-plain-defaults is
    # issue 60's number, depth 6 what a drafting step costs there
    mrv2 = {**triforce, "name": "costs-triforce-mrv2", "env": MRV2_SETTINGS["env"],
            "cases": cases[:2], "depths": [0, 6], "many_requests": None,
            "llm": {**tri_llm, "async_scheduling": True,
                    "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}}}
    return [defaults, triforce, forced, kept, kept_plain, mrv2]


def _tax_jobs(defaults: dict) -> list[dict]:
    """Issue 60's first GPU question: the tax of TriForce's settings split by setting, and
    a spec-decode engine's (1 + K)-token FULL step (TAX_SETTINGS, TAX_SPEC)."""
    main = [c for c in defaults["cases"] if c["name"] in ("8x32K", "1x128K")]
    decode_sizes = sorted({c["batch"] for c in main})
    jobs = []
    for name, v2, mode, async_on in TAX_SETTINGS:
        jobs.append({**defaults, "name": name, "cases": main, "estimate_s": 150,
                     "env": {"VLLM_USE_V2_MODEL_RUNNER": v2},
                     "llm": {**defaults["llm"], "async_scheduling": async_on,
                             "compilation_config": {"cudagraph_mode": mode,
                                                    "cudagraph_capture_sizes": decode_sizes}}})
    k = TAX_SPEC["num_speculative_tokens"]
    first = main[:1]  # 8 x 32K
    spec_sizes = sorted({c["batch"] * (1 + k) for c in first})
    jobs.append({**defaults, "name": "tax-spec-filler", "cases": first, "estimate_s": 130,
                 "spec": dict(TAX_SPEC), "env": {"VLLM_USE_V2_MODEL_RUNNER": "1"},
                 "llm": {**defaults["llm"],
                         "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE",
                                                "cudagraph_capture_sizes": spec_sizes}}})
    return jobs
