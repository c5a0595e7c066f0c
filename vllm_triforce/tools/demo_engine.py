"""One engine of `vllm-triforce demo` in a child process of its own (vLLM keeps one
engine's parallel state per process), answering the demo's commands over a pipe, and the
TriForce counters of each of its decodes."""

from __future__ import annotations

import os
import time

from vllm_triforce.offline import drafter_of, free_llm, in_process_llm


def engine_process(conn, model_dir, spec, prompts, args, eager: bool) -> None:
    """One engine in this child process (the parent's environment): built and prefilled
    before the first answer (`ready`: how it runs and its prefill time), then per command
    one timed decode (`decode`), one at the full depth (`fixed`: with its own draft counts
    and TriForce's counts before it), or plain's top-2 log-prob margins (`margins`), until
    `quit` or the parent goes."""
    import traceback

    if args.log:  # vLLM's log (and every library's) goes to the demo's log file
        log = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
    try:
        llm, prefill_s = _engine(model_dir, spec, prompts, args, eager)
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        drafter = drafter_of(llm) if spec else None
        ready = {"mode": "eager" if eager else "compiled", "prefill_s": prefill_s}
        while True:
            command, reply = conn.recv(), None
            if command == "quit":
                break
            if command == "ready":  # the prefill above is done
                reply = ready
            elif command == "margins":
                from vllm_triforce.tools.bench.gpu_engine import top2_margins

                logged = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                        ignore_eos=True, logprobs=2)
                reply = [top2_margins(o.outputs[0])
                         for o in llm.generate(prompts, logged, use_tqdm=False)]
            elif command in ("decode", "fixed"):
                before = drafter.stats.snapshot() if drafter else None
                if command == "fixed":
                    drafter.set_fixed_depth(args.gamma)
                try:
                    reply = _decode(llm, prompts, params, prefill_s)
                finally:
                    if command == "fixed":
                        drafter.set_fixed_depth(None)
                if drafter:  # this run's own counts: after minus before
                    reply["triforce"] = count_delta(before, drafter.stats.snapshot())
                    reply["counts_before"] = before
            conn.send(("ok", reply))
        free_llm(llm)
    except EOFError:  # the parent went away
        pass
    except Exception:  # noqa: BLE001 -- reported to the parent, which raises it
        conn.send(("error", traceback.format_exc()))


def _engine(model_dir, spec, prompts, args, eager: bool):
    """(LLM, seconds of prefill and warm-up): the engine, its prompts prefilled with 1 token
    (the prefix cache keeps their KV, so each timed decode's prefill is a prefix-cache
    hit), then WARM_UP_TOKENS decoded untimed. On
    CPU: eager, blocks of 32 tokens; on a GPU: vLLM's defaults (compiled unless `eager`)
    within `--gpu-memory-utilization`."""
    from vllm import SamplingParams

    max_len = args.prompt_tokens + args.max_tokens + 2 * args.gamma + 64
    device = ({"enforce_eager": True, "block_size": 32} if args.device == "cpu" else
              {"enforce_eager": eager, "gpu_memory_utilization": args.gpu_memory_utilization})
    llm = in_process_llm(model_dir, spec, dtype=args.dtype, seed=0, max_model_len=max_len,
                         disable_log_stats=False, **device)
    start = time.perf_counter()
    for max_tokens in (1, WARM_UP_TOKENS):
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                             ignore_eos=True), use_tqdm=False)
    return llm, time.perf_counter() - start


# After the prefill, both engines decode a few tokens untimed: TriForce sets the summaries
# of a prompt's blocks at its first selection (once per cached prefix, like its prefill),
# and both engines' first decodes warm their caches.
WARM_UP_TOKENS = 4


DRAFT_COUNTS = ("top_proposed", "top_accepted", "middle_proposed", "middle_accepted")
GAUGES = ("live_requests", "max_pass_tokens", "predicted_tokens_per_s", "achieved_tokens_per_s")


def count_delta(before: dict, after: dict) -> dict:
    """TriForce's counters of one run: `after` minus `before` (gauges: `after`'s)."""
    out = {}
    for key, value in after.items():
        if key in GAUGES:
            out[key] = value
        elif isinstance(value, list):
            old = before.get(key) or []
            out[key] = [v - (old[i] if i < len(old) else 0) for i, v in enumerate(value)]
        else:
            out[key] = value - before.get(key, 0)
    return out


def sum_counts(runs: list[dict]) -> dict:
    """The counters of several runs together (gauges: the last run's)."""
    out = dict(runs[-1])
    for key, value in runs[-1].items():
        if key in GAUGES:
            continue
        if isinstance(value, list):
            width = max(len(r[key]) for r in runs)
            out[key] = [sum(r[key][i] for r in runs if i < len(r[key])) for i in range(width)]
        else:
            out[key] = sum(r[key] for r in runs)
    return out


def _decode(llm, prompts, params, prefill_s: float) -> dict:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    decode_s = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"tokens": tokens, "prefill_s": prefill_s, "decode_s": decode_s,
            "tok_s": sum(map(len, tokens)) / decode_s, "metrics": _metrics(llm),
            "text": outs[0].outputs[0].text}


def _metrics(llm) -> dict:
    return {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
