"""Plain vLLM against TriForce, decode by decode, in two live processes taking turns.

`bench speed --rounds` alternates whole processes, a couple of minutes apart; on a shared
2-vCPU host one process's decode runs 15-40% faster or slower than the next one's
(benchmarks/history/short_job_2026-11-29: plain vLLM under TriForce's settings read 0.96, 1.00,
1.39 and 0.98 of plain in its four rounds, with nothing between them that a CPU runs
differently), so four rounds cannot tell 0.98x from 1.00x. Here both engines are built once,
each in its own process, and take turns: one timed generation of `--max-tokens` tokens
(prefix-cached prompts, so decode), then the other's, in the order ABBA ABBA ..., the other
process idle (blocked on its pipe) meanwhile. A pair's ratio sees the host's state of a few
seconds, so the median of the pairs' ratios resolves a few percent where rounds do not.

The default shape is issue 60's short job: SmolLM2-135M, 2 x 1,500 tokens, 48 new, greedy,
TriForce's default config (retrieval budget 4,096, so no request can draft). `--depth K`
fixes TriForce's depth (`set_fixed_depth`) instead of its controller. The tokens of every
generation are compared with plain vLLM's, and TriForce's drafted and accepted counts are
printed (at depth 0 and in the short job they are 0: the point is what a step that drafts
nothing costs). `--control` makes the second engine plain vLLM too: on a 2-vCPU Intel Xeon
(AMX) on 2026-12-01 that A/A run read 0.969 (pairs' median; 0.957 the medians' ratio) over
20 turns, so the engine built second runs a few percent slower here whatever it is; TriForce
read 0.950 (0.952) over 30 turns beside it. Read a ratio against the control's, or run
both build orders (`--triforce-first`): the geometric mean of the two ratios cancels the order's
bias. `--split` times vLLM's model forward apart from the rest of each turn: on a 2-core AMD
EPYC (2026-12-02) the forwards read 1.002 (medians' ratio) and the rest 5.58 against 5.78 ms a
token, so TriForce's whole cost in a step that drafts nothing is outside the forward and about
0.2 ms of 37 ms, where the turns' totals spread 0.80-1.28 from pair to pair.

    .venv/bin/python benchmarks/explore/paired_decode.py [--pairs 16] [--depth K]
        [--prompt-tokens 1500] [--batch 2] [--max-tokens 48] [--budget 4096]
        [--control] [--triforce-first] [--split]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

ENGINES = ("plain", "triforce2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--budget", type=int, default=4096, help="TriForce retrieval_budget")
    parser.add_argument("--gamma", type=int, default=6, help="num_speculative_tokens")
    parser.add_argument("--depth", type=int, default=None,
                        help="fix TriForce's depth (default: its controller)")
    parser.add_argument("--pairs", type=int, default=16,
                        help="timed generations per engine (even: ABBA order)")
    parser.add_argument("--control", action="store_true",
                        help="an A/A control: the second engine is plain vLLM too (built "
                             "second, as TriForce's is), so the ratio shows the design's bias")
    parser.add_argument("--triforce-first", action="store_true",
                        help="build TriForce's engine (or the control's second plain one) "
                             "first; run both orders to cancel the build order's bias")
    parser.add_argument("--split", action="store_true",
                        help="also time vLLM's model forward (GPUModelRunner._model_forward) "
                             "in each turn: the ratio of the forwards and of the rest of the "
                             "step, apart")
    parser.add_argument("--pause", type=float, default=0.5,
                        help="seconds between turns (an idle OpenMP pool stops spinning)")
    args = parser.parse_args()

    from vllm_triforce.assets import ensure_model
    from vllm_triforce.tools.bench import prompts as bench_prompts

    model = str(ensure_model(args.model))
    job = {"model": model, "prompts": bench_prompts.book_prompts(model, args.prompt_tokens,
                                                                  args.batch),
           "max_tokens": args.max_tokens, "depth": args.depth, "control": args.control,
           "split": args.split,
           "spec": {"method": "triforce", "num_speculative_tokens": args.gamma,
                    "retrieval_budget": args.budget},
           "max_model_len": args.prompt_tokens + args.max_tokens + 2 * args.gamma + 64}
    ctx = multiprocessing.get_context("spawn")
    pipes, procs = {}, []
    build = ENGINES[::-1] if args.triforce_first else ENGINES
    for engine in build:  # built one after the other: a start-up is not timed against a turn
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(child, engine, job), daemon=True)
        proc.start()
        pipes[engine] = parent
        procs.append(proc)
        ready = parent.recv()
        print(f"{engine}: ready ({ready})", flush=True)
    times = {e: [] for e in ENGINES}
    forwards = {e: [] for e in ENGINES}  # seconds inside vLLM's model forward (`--split`)
    tokens = {}
    for turn in range(args.pairs):
        order = ENGINES if turn % 2 == 0 else ENGINES[::-1]
        for engine in order:
            time.sleep(args.pause)
            pipes[engine].send("go")
            seconds, toks, forward = pipes[engine].recv()
            times[engine].append(seconds)
            forwards[engine].append(forward)
            tokens.setdefault(engine, toks)
            if toks != tokens[engine]:
                tokens[engine] = None  # a generation gave other tokens than the first
    for engine in ENGINES:
        pipes[engine].send("stats")
    counts = pipes["triforce2"].recv()
    pipes["plain"].recv()
    counts = counts or {"drafted": 0, "accepted": 0}
    for engine in ENGINES:
        pipes[engine].send("stop")
    for proc in procs:
        proc.join(timeout=60)
    _report(args, times, tokens, counts)
    if args.split:
        _report_split(args, times, forwards)


def _report_split(args, times: dict, forwards: dict) -> None:
    """The forwards' and the rest's ms per token, and TriForce / plain per turn pair."""
    print("  split (--split): ms per token inside vLLM's model forward / outside it")
    rest = {e: [t - f for t, f in zip(times[e], forwards[e])] for e in ENGINES}
    for engine in ENGINES:
        fwd = statistics.median(forwards[engine]) * 1000 / args.max_tokens
        other = statistics.median(rest[engine]) * 1000 / args.max_tokens
        print(f"  {engine:10s} forward median {fwd:.2f}, rest median {other:.2f}")
    for name, parts in (("forward", forwards), ("rest", rest)):
        ratios = [p / t for p, t in zip(parts["plain"], parts["triforce2"])]
        print(f"  TriForce / plain speed of the {name}, per turn pair: median "
              f"{statistics.median(ratios):.3f}; ratio of the medians "
              f"{statistics.median(parts['plain']) / statistics.median(parts['triforce2']):.3f}")


def _report(args, times: dict, tokens: dict, counts: dict) -> None:
    steps = args.max_tokens
    ratios = [p / t for p, t in zip(times["plain"], times["triforce2"])]  # TriForce's speed
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    depth = "the controller" if args.depth is None else f"fixed depth {args.depth}"
    if args.control:
        depth += "; CONTROL: the `triforce2` rows are a second plain vLLM engine"
    depth += f"; built first: {'triforce2' if args.triforce_first else 'plain'}"
    print(f"\n{args.batch} x {args.prompt_tokens} tokens, {args.max_tokens} new, greedy; "
          f"TriForce budget {args.budget}, gamma {args.gamma}, {depth}; "
          f"{args.pairs} turns each, ABBA")
    for engine in ENGINES:
        ms = [1000 * s / steps for s in times[engine]]
        print(f"  {engine:10s} ms/token by turn: {' '.join(f'{m:.1f}' for m in ms)}")
    for engine in ENGINES:
        ms = [1000 * s / steps for s in times[engine]]
        print(f"  {engine:10s} ms/token: median {statistics.median(ms):.2f}, "
              f"min {min(ms):.2f}, max {max(ms):.2f}")
    print(f"  TriForce / plain speed, per turn pair: median {statistics.median(ratios):.3f}, "
          f"quartiles {q[0]:.3f} .. {q[2]:.3f}, range {min(ratios):.3f} .. {max(ratios):.3f}")
    print(f"  ratio of the medians: "
          f"{statistics.median(times['plain']) / statistics.median(times['triforce2']):.3f}")
    same = tokens.get("plain") is not None and tokens.get("plain") == tokens.get("triforce2")
    print(f"  greedy tokens identical to plain vLLM's in every turn: {'yes' if same else 'NO'}")
    print(f"  TriForce drafted {counts['drafted']} tokens, {counts['accepted']} accepted "
          f"(vLLM's counters over the timed turns)")


def _worker(conn, engine: str, job: dict) -> None:
    """One engine, built here; answers "go" with (seconds, tokens) of one generation,
    "stats" with vLLM's spec-decode counters, "stop" by returning."""
    from vllm_triforce.tools.bench.worker import ENGINE_ENV

    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import SamplingParams

    from vllm_triforce.offline import drafter_of, in_process_llm
    from vllm_triforce.tools.bench.worker import counter_delta, spec_metrics

    spec = job["spec"] if engine == "triforce2" and not job["control"] else None
    start = time.perf_counter()
    llm = in_process_llm(job["model"], spec, dtype="float32", enforce_eager=True, block_size=32,
                         seed=0, max_model_len=job["max_model_len"], disable_log_stats=False,
                         enable_prefix_caching=True)
    if spec is not None and job["depth"] is not None:
        drafter_of(llm).set_fixed_depth(job["depth"])
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                 use_tqdm=False)  # prefill: the timed generations hit the prefix cache
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    forward_seconds = _time_forwards() if job["split"] else None
    before = spec_metrics(llm)
    conn.send(f"built and warmed in {time.perf_counter() - start:.0f} s")
    while True:
        command = conn.recv()
        if command == "go":
            forward_before = forward_seconds[0] if forward_seconds else 0.0
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            forward = forward_seconds[0] - forward_before if forward_seconds else 0.0
            conn.send((seconds, [list(o.outputs[0].token_ids) for o in outs], forward))
        elif command == "stats":
            counts = counter_delta(spec_metrics(llm), before)
            conn.send({"drafted": int(counts.get("vllm:spec_decode_num_draft_tokens", 0)),
                       "accepted": int(counts.get("vllm:spec_decode_num_accepted_tokens", 0))})
        else:
            return


def _time_forwards() -> list[float]:
    """Wraps vLLM's runner's model forward (`in_process_llm`: the engine runs in this
    process) with a clock; returns the one-item list its seconds add up in."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    total = [0.0]
    forward = GPUModelRunner._model_forward

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return forward(self, *args, **kwargs)
        finally:
            total[0] += time.perf_counter() - start

    GPUModelRunner._model_forward = timed
    return total


if __name__ == "__main__":
    main()
