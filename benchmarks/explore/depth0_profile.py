"""Where a step without drafts goes: plain vLLM against TriForce forced to depth 0 (issue 26).

One process per engine (run it twice, alternating `--engine`), the README demo's shape by
default (SmolLM2-135M, 2 x 4,096-token prompts from the bundled book, greedy). It times the
decode of `--max-tokens` tokens, then profiles one more decode with cProfile and prints the
cumulative seconds per step of the functions that differ between the engines: vLLM's
model forward, sampling and speculative bookkeeping, and TriForce's `propose` with its parts
(StepBatch, commit, the controller, metrics).

    .venv/bin/python benchmarks/explore/depth0_profile.py --engine plain
    .venv/bin/python benchmarks/explore/depth0_profile.py --engine triforce2
        [--depth -1 --budget 512] [--schedule 0] [--no-plan-ahead]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time


WATCH = ("propose", "from_runner", "begin_step", "fold", "add_committed",
         "set_full_blocks", "set_blocks", "begin",
         "plan", "end", "_publish_stats", "write_snapshot", "maybe_log", "_step",
         "propose_draft_token_ids", "execute_model", "sample_tokens", "_sample",
         "rejection_sampler", "forward", "_calc_spec_decode_metadata", "schedule",
         "update_from_output", "_bookkeeping_sync", "step", "_update_states",
         "_prepare_inputs", "captured_forward", "_model_forward")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("plain", "plain-sync", "triforce2"), required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--depth", type=int, default=0,
                        help="the depth TriForce is forced to (0: the issue-26 case; "
                             "-1: its controller)")
    parser.add_argument("--budget", type=int, default=512, help="TriForce retrieval_budget "
                        "(4,096, the default config's, with --prompt-tokens 1500 --depth -1: "
                        "issue 60's short job, where no request can draft)")
    parser.add_argument("--schedule", type=int, nargs="+", default=None,
                        help="with --depth -1: the controller plans these depths in turn "
                             "(tools/bench/forcing.schedule_depths; 0: held plain)")
    parser.add_argument("--no-plan-ahead", action="store_true",
                        help="TriForce's controller plans only after vLLM's pass (no "
                             "`plan_ahead`: a step it keeps at depth 0 past the budget is "
                             "not a host plain step)")
    args = parser.parse_args()

    from vllm import SamplingParams

    from vllm_triforce.assets import ensure_model
    from vllm_triforce.offline import drafter_of, in_process_llm
    from vllm_triforce.tools.bench import prompts as bench_prompts

    model = str(ensure_model(args.model))
    ids = bench_prompts.book_prompts(model, args.prompt_tokens, args.batch)
    spec = None
    if args.engine.startswith("triforce"):
        spec = {"method": "triforce", "num_speculative_tokens": 6, "retrieval_budget": args.budget}
    llm = in_process_llm(model, spec, dtype="float32", enforce_eager=True, block_size=32, seed=0,
                         max_model_len=args.prompt_tokens + args.max_tokens + 2 * 6 + 64,
                         **({"async_scheduling": False} if args.engine == "plain-sync" else {}))
    if spec and args.depth >= 0:
        drafter_of(llm).set_fixed_depth(args.depth)
    if spec and args.depth < 0 and args.schedule:
        from vllm_triforce.tools.bench.forcing import schedule_depths

        schedule_depths(drafter_of(llm).depth.controller, args.schedule)
    if spec and args.no_plan_ahead:
        drafter_of(llm).plan_ahead = False
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ids]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def decode_seconds() -> float:
        start = time.perf_counter()
        llm.generate(prompts, one, use_tqdm=False)  # prefill (prefix-cached after the first)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start - prefill

    decode_seconds()  # warm-up, fills the prefix cache
    before = drafter_of(llm).stats.snapshot() if spec else None
    timed = [decode_seconds() for _ in range(2)]
    if spec:  # TriForce's own time in `propose`, per step (prefill steps included)
        after = drafter_of(llm).stats.snapshot()
        calls = 2 * args.max_tokens
        print(f"propose: {1000 * (after['middle_seconds'] - before['middle_seconds']) / calls:.3f} "
              f"ms per call over {calls} calls")
    steps = args.max_tokens - 1
    print(f"{args.engine}: decode {min(timed):.3f} s for {steps} steps = "
          f"{1000 * min(timed) / steps:.2f} ms/step (runs {', '.join(f'{t:.3f}' for t in timed)})")
    profiler = cProfile.Profile()
    profiler.enable()
    decode_seconds()
    profiler.disable()
    stats = pstats.Stats(profiler)
    calls = sum(nc for (_cc, nc, _tt, _ct, _callers) in stats.stats.values())
    print(f"Python function calls: {calls / steps:.0f} per step")
    rows = []
    for (path, line, name), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():
        if (name in WATCH and "vllm" in path) or "vllm_triforce" in path:
            short = path.split("site-packages/")[-1].split("vllm-triforce/")[-1]
            rows.append((ct, f"{short}:{line} {name}"))
    for ct, where in sorted(rows, reverse=True)[:args.top]:
        print(f"  {1000 * ct / steps:8.2f} ms/step  {where}")
    if spec:
        snap = drafter_of(llm).stats.snapshot()
        print("drafted:", snap["top_proposed"], "host plain steps:", snap["host_plain_steps"],
              "depths:", snap["depth_counts"])


if __name__ == "__main__":
    main()
