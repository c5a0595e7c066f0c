"""`vllm-triforce demo`: TriForce against plain vLLM on long Moby-Dick prompts.

Runs the same greedy requests on a plain engine and on a TriForce engine, each in a child
process of its own and both alive for the whole run (CPU settings that make outputs
comparable: fp32, eager): after each engine's prefill, `--rounds` rounds in which each
engine decodes once, the two in turn (which goes first alternates), so a host whose speed
drifts over minutes slows both alike. It prints decode tokens/s, the speedup of each round
and their median, acceptance at each TriForce level, and whether the outputs are
token-for-token identical, with the draft counts behind that verdict: an engine that never drafted
decodes plainly and equals plain vLLM trivially, so the demo fails (exit 1) if the
fixed-depth run drafted nothing. Both engines start with Intel OpenMP preloaded, as vLLM's CPU
installation guide sets up (`cpu_openmp.with_intel_openmp`).

Default: SmolLM2-135M, two levels, 4 x 7,936 tokens: the KV cache (1.5 GB in fp32) is
three times the weights, TriForce's regime, where a middle round over a 512-token
retrieval cache costs a fraction of a plain step. `--three-level`: Qwen2.5-Coder-1.5B
target with the Qwen2.5-Coder-0.5B draft (fetches ~1.6 GB of packages the first time).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

from vllm_triforce.cpu_openmp import named_runtime, with_intel_openmp
from vllm_triforce.offline import drafter_of, free_llm

# Each of the two engines gets 2 GiB of KV cache: 4 x 8K SmolLM2 tokens in fp32 need 1.4.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_TARGET_DEVICE": "cpu",
              "VLLM_CPU_KVCACHE_SPACE": "2",
              "HF_HUB_OFFLINE": "1"}


# Engines on an NVIDIA GPU: vLLM's own defaults for the plain engine (compiled, CUDA graphs,
# V2 model runner, async scheduling), TriForce's forced settings for its own; in-process
# engines (the TriForce engine's counters are read from its proposer), no CPU variables.
GPU_ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
# What each device runs unless told otherwise. CPU: 4 x 7,936 tokens in float32 (exact
# comparison). GPU: 32 x 7,808 tokens in bf16, where the KV cache (5.9 GB) is 22x the
# weights; 7,808 + 256 new tokens + the drafting margin fit SmolLM2's 8,192-token context.
DEVICE_DEFAULTS = {
    "cpu": {"prompt_tokens": 7936, "max_tokens": 96, "batch": 4, "dtype": "float32"},
    "cuda": {"prompt_tokens": 7808, "max_tokens": 256, "batch": 32, "dtype": "bfloat16"},
}


def add_demo_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="TriForce vs plain vLLM on a long book prompt")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: an NVIDIA GPU when torch sees one, else the CPU")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="tokens per prompt (default: 7,936 on CPU, 7,808 on a GPU)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="new tokens per request (default: 96 on CPU, 256 on a GPU)")
    p.add_argument("--batch", type=int, default=None,
                   help="requests, different book passages (default: 4 on CPU, 32 on a GPU)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of one timed decode per engine (the speedup of each round and "
                        "their median)")
    p.add_argument("--budget", type=int, default=512, help="retrieval_budget (tokens)")
    p.add_argument("--gamma", type=int, default=6, help="num_speculative_tokens (gamma2)")
    p.add_argument("--three-level", action="store_true",
                   help="Qwen2.5-Coder-1.5B target + Qwen2.5-Coder-0.5B draft")
    p.add_argument("--dtype", default=None,
                   help="model dtype (default: float32 on CPU, an exact comparison; bfloat16 "
                        "on a GPU, where a divergence must sit at a near-tie of plain vLLM's "
                        "own log-probs)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                   help="GPU: each engine's share of the GPU (both stay alive)")
    p.add_argument("--out", default=None,
                   help="also write the results as JSON to this file, after every round")
    p.add_argument("--eager-check", action="store_true",
                   help="after the rounds, the fixed-depth decode once more on an eager "
                        "TriForce engine: its acceptance must match the compiled engine's "
                        "(within 3 points), or CUDA graphs changed what TriForce reads")
    p.set_defaults(func=run_demo)


def resolve_device(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with the device decided and every size left unset taken from it."""
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    for key, value in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def run_demo(args: argparse.Namespace) -> int:
    args = resolve_device(args)
    for key, value in (ENGINE_ENV if args.device == "cpu" else GPU_ENGINE_ENV).items():
        os.environ.setdefault(key, value)
    if args.device == "cpu":
        os.environ.update(with_intel_openmp(os.environ))  # read as each engine's process starts
    from vllm_triforce import assets

    target = assets.ensure_model("qwen2.5-coder-1.5b" if args.three_level else "smollm2-135m")
    draft = assets.ensure_model("qwen2.5-coder-0.5b") if args.three_level else None
    spec = {"method": "triforce", "num_speculative_tokens": args.gamma,
            "retrieval_budget": args.budget}
    if draft is not None:
        spec.update(model=str(draft), draft_tokens_per_round=2, draft_window_tokens=480)
    prompts = _book_prompts(target, args.prompt_tokens, args.batch)
    print(f"target {target.name}, {args.batch} x {args.prompt_tokens}-token Moby-Dick prompts, "
          f"{args.max_tokens} new tokens, greedy; TriForce {spec}", flush=True)
    print(_regime(target, args), flush=True)
    if args.device == "cpu":
        print(_openmp_line(os.environ.get("LD_PRELOAD", "")), flush=True)
    plain, tri, fixed = _run(target, spec, prompts, args)
    _report(plain, tri, fixed, args.gamma)
    if args.out:
        from vllm_triforce.bench.gpu_summary import compare_tokens

        verdict = compare_tokens(plain["tokens"], tri["tokens"], plain.get("margins"))
        fixed_verdict = compare_tokens(plain["tokens"], fixed["tokens"], plain.get("margins"))
        print(f"verdict against plain vLLM: controller {_verdict(verdict)}; fixed k={args.gamma} "
              f"{_verdict(fixed_verdict)}")
        for name, run in (("controller", tri), (f"fixed k={args.gamma}", fixed)):
            c = step_costs(run["rounds"][-1], args.max_tokens)
            print(f"TriForce {name}, last round: {c['ms_per_step']:.2f} ms per step "
                  f"({c['tokens_per_step']:.2f} tokens per request per step), of which "
                  f"proposer {c['proposer_ms_per_step']:.2f} ms, vLLM {c['vllm_ms_per_step']:.2f}"
                  f" ms; {c['middle_rounds_per_step']:.2f} middle rounds per step at "
                  f"{_ms(c['ms_per_middle_round'])} ms ({_ms(c['forward_ms_per_middle_round'])} "
                  "ms of model forward)", flush=True)
        _save(args, plain, tri, fixed, verdict, fixed_verdict)
        if "eager_check" in fixed and not fixed["eager_check"]["agree"]:
            return 1
        ok = verdict["explained"] and fixed_verdict["explained"]
        return 0 if ok and fixed["triforce"]["top_proposed"] else 1
    if not fixed["triforce"]["top_proposed"]:
        print(f"\nERROR: TriForce drafted nothing in the fixed k={args.gamma} run: no draft "
              "reached vLLM's verification, so the identity above proves nothing.",
              file=sys.stderr, flush=True)
        return 1
    same = (plain["tokens"] == tri["tokens"] == fixed["tokens"]
            and plain["same_each_round"] and tri["same_each_round"])
    return 0 if same else 1


def _openmp_line(ld_preload: str) -> str:
    runtime = named_runtime(ld_preload)
    if runtime == "Intel OpenMP":
        return ("Both engines run with Intel OpenMP preloaded, as vLLM's CPU guide sets up "
                "(LD_PRELOAD).")
    if runtime:
        return f"Both engines run with the OpenMP runtime your LD_PRELOAD names ({runtime})."
    return ("Intel OpenMP (the intel-openmp package) is not installed: both engines run GNU "
            "OpenMP, under which vLLM warns that speculative decoding on CPU is slower.")


def _book_prompts(model_dir, num_tokens: int, batch: int) -> list[dict]:
    from transformers import AutoTokenizer

    from vllm_triforce.assets import moby_dick_text

    ids = AutoTokenizer.from_pretrained(str(model_dir))(moby_dick_text())["input_ids"]
    stride = max((len(ids) - num_tokens) // max(batch, 1), 1)
    return [{"prompt_token_ids": ids[i * stride: i * stride + num_tokens]} for i in range(batch)]


def _run(model_dir, spec, prompts, args):
    """(plain, TriForce with its depth controller, the same TriForce engine with every
    request forced to the full depth: fixed-gamma TriForce), after `args.rounds` rounds in
    which the two engines decode in turn (which goes first alternates). vLLM keeps one
    engine's parallel state per process, so each engine lives in a child process of its own
    (`_engine_process`), both alive for the whole run, each decoding when told. On a GPU the
    fixed-depth decode runs in every round, right after the controller's, and plain vLLM
    decodes once more, untimed, for its top-2 log-prob margins (the bf16 verdict)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    engines, modes = {}, {}
    rounds = {"plain": [], "triforce": [], "fixed": []}
    every_round = args.out is not None
    try:
        for name, engine_spec in (("plain", None), ("triforce", spec)):
            # one prefill at a time: the two would share the device
            proc, conn, modes[name] = _start(context, model_dir, engine_spec, prompts, args)
            engines[name] = (proc, conn)
        for i in range(max(args.rounds, 1)):
            for name in (list(engines) if i % 2 == 0 else list(reversed(engines))):
                rounds[name].append(_ask(engines[name][1], "decode"))
                if name == "triforce" and every_round:
                    rounds["fixed"].append(_ask(engines[name][1], "fixed"))
            if args.out:
                _save_rounds(args, rounds, modes)
        plain, tri = ({**r[-1], "round_tok_s": [x["tok_s"] for x in r],
                       "same_each_round": all(x["tokens"] == r[0]["tokens"] for x in r)}
                      for r in (rounds["plain"], rounds["triforce"]))
        plain["engine"], tri["engine"] = modes["plain"], modes["triforce"]
        if every_round:
            fixed = {**rounds["fixed"][-1], "round_tok_s": [x["tok_s"] for x in rounds["fixed"]],
                     "triforce": sum_counts([x["triforce"] for x in rounds["fixed"]])}
            tri["triforce"] = sum_counts([x["triforce"] for x in rounds["triforce"]])
            tri["rounds"], fixed["rounds"] = rounds["triforce"], rounds["fixed"]
            plain["margins"] = _ask(engines["plain"][1], "margins")
        else:
            fixed = _ask(engines["triforce"][1], "fixed")
            tri["triforce"] = fixed.pop("counts_before")  # the controller's run and its warm-up
    finally:
        for proc, conn in engines.values():
            _stop(proc, conn)
    if getattr(args, "eager_check", False):
        fixed["eager_check"] = _eager_check(context, model_dir, spec, prompts, args, fixed)
    return plain, tri, fixed


def _eager_check(context, model_dir, spec, prompts, args, fixed) -> dict:
    """The fixed-depth decode on an eager TriForce engine, against the compiled engine's
    (`fixed`, all rounds): acceptance within 3 points, and the same tokens."""
    proc, conn, _ = _start(context, model_dir, spec, prompts, args, eager_only=True)
    try:
        eager = _ask(conn, "fixed")
    finally:
        _stop(proc, conn)
    rate = lambda c: c["top_accepted"] / c["top_proposed"] if c["top_proposed"] else None
    compiled, eager_rate = rate(fixed["triforce"]), rate(eager["triforce"])
    agree = (compiled is not None and eager_rate is not None
             and abs(compiled - eager_rate) <= 0.03)
    print(f"capture check: fixed-depth acceptance compiled {compiled:.3f} "
          f"({fixed['triforce']['top_accepted']}/{fixed['triforce']['top_proposed']}), eager "
          f"{eager_rate:.3f} ({eager['triforce']['top_accepted']}/"
          f"{eager['triforce']['top_proposed']}): {'agree' if agree else 'DIFFER'} within 3 "
          f"points; tokens {'equal' if eager['tokens'] == fixed['tokens'] else 'differ'}",
          flush=True)
    return {"compiled_acceptance": compiled, "eager_acceptance": eager_rate, "agree": agree,
            "eager_counts": {k: eager["triforce"][k] for k in DRAFT_COUNTS},
            "same_tokens": eager["tokens"] == fixed["tokens"]}


def _start(context, model_dir, spec, prompts, args, eager_only: bool = False):
    """(process, connection, how the engine runs) of one engine, built and prefilled. On a
    GPU an engine that fails to start compiled (torch.compile, CUDA graphs) is started
    again eager, and says so: its numbers are then eager ones."""
    attempts = (False, True) if args.device == "cuda" and not eager_only else (True,)
    for eager in attempts:
        parent, child = context.Pipe()
        proc = context.Process(target=_engine_process,
                               args=(child, model_dir, spec, prompts, args, eager))
        proc.start()
        try:
            return proc, parent, _ask(parent, "ready")
        except RuntimeError as err:
            _stop(proc, parent)
            if eager:
                raise
            last = str(err).strip().splitlines()[-1]
            print(f"{'TriForce' if spec else 'plain'} engine failed to start compiled "
                  f"({last}); starting it eager", flush=True)
    raise AssertionError("unreachable")


def _stop(proc, conn) -> None:
    try:
        conn.send("quit")
    except OSError:  # it already went
        pass
    proc.join(timeout=60)
    conn.close()
    if proc.is_alive():
        proc.kill()


def _ask(conn, command: str):
    conn.send(command)
    status, value = conn.recv()
    if status != "ok":
        raise RuntimeError(f"demo engine process failed on {command!r}:\n{value}")
    return value


def _engine_process(conn, model_dir, spec, prompts, args, eager: bool) -> None:
    """One engine in this child process (the parent's environment): built and prefilled
    before the first answer (`ready`: how it runs and its prefill time), then per command
    one timed decode (`decode`), one at the full depth (`fixed`: with its own draft counts
    and TriForce's counts before it), or plain's top-2 log-prob margins (`margins`), until
    `quit` or the parent goes."""
    import traceback

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
                from vllm_triforce.bench.gpu_job import _margins

                logged = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                        ignore_eos=True, logprobs=2)
                reply = [_margins(o.outputs[0])
                         for o in llm.generate(prompts, logged, use_tqdm=False)]
            elif command in ("decode", "fixed"):
                before = drafter.stats.snapshot() if drafter else None
                if command == "fixed":
                    drafter.depth.controller.forced = [args.gamma]
                try:
                    reply = _decode(llm, prompts, params, prefill_s)
                finally:
                    if command == "fixed":
                        drafter.depth.controller.forced = None
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
    """(LLM, prefill seconds): the engine, its prompts prefilled with 1 token, so the
    prefix cache keeps their KV and each timed decode's prefill is a prefix-cache hit. On
    CPU: eager, blocks of 32 tokens; on a GPU: vLLM's defaults (compiled unless `eager`)
    within `--gpu-memory-utilization`."""
    from vllm import LLM, SamplingParams

    max_len = args.prompt_tokens + args.max_tokens + 2 * args.gamma + 64
    device = ({"enforce_eager": True, "block_size": 32} if args.device == "cpu" else
              {"enforce_eager": eager, "gpu_memory_utilization": args.gpu_memory_utilization})
    llm = LLM(str(model_dir), dtype=args.dtype, seed=0, max_model_len=max_len,
              speculative_config=spec, disable_log_stats=False, **device)
    prefill = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, prefill, use_tqdm=False)
    return llm, time.perf_counter() - start


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


def _num_params(model_dir) -> int:
    """Parameters in the checkpoint, from its safetensors headers (no weights read)."""
    total = 0
    for path in model_dir.glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total


def _regime(model_dir, args) -> str:
    """One line: the batch's KV cache against the weights, and what that means for TriForce.
    A plain decode step reads both; a middle round reads the weights and the retrieval
    cache only, so drafting pays where the KV cache outweighs the weights."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    width = 2 if args.dtype in ("bfloat16", "float16", "half") else 4
    kv = (args.batch * (args.prompt_tokens + args.max_tokens) * config["num_hidden_layers"]
          * 2 * config["num_key_value_heads"] * head_dim * width)
    weights = _num_params(model_dir) * width
    verdict = ("TriForce's regime: a middle round reads the weights and a "
               f"{args.budget}-token retrieval cache, a fraction of a plain step"
               if kv > weights else
               "weight-bound: a middle round costs nearly a plain step, so drafting cannot "
               "pay and the controller decodes plainly (try a larger --batch or "
               "--prompt-tokens, with VLLM_CPU_KVCACHE_SPACE in GiB raised to hold them)")
    return (f"KV cache {kv / 2**30:.2f} GiB against weights {weights / 2**30:.2f} GiB "
            f"({args.dtype}): {verdict}.")


def _report(plain: dict, tri: dict, fixed: dict, gamma: int) -> None:
    from vllm_triforce.engine.stats import format_snapshot

    ratios = [t / p for t, p in zip(tri["round_tok_s"], plain["round_tok_s"])]
    speedup = statistics.median(ratios)
    print(f"\nplain vLLM            : {statistics.median(plain['round_tok_s']):7.2f} tok/s "
          f"decode (prefill {plain['prefill_s']:.1f} s)")
    print(f"TriForce (controller) : {statistics.median(tri['round_tok_s']):7.2f} tok/s decode "
          f"(prefill {tri['prefill_s']:.1f} s), speedup {speedup:.2f}x (median; rounds "
          f"{', '.join(f'{r:.2f}x' for r in ratios)})")
    print(f"TriForce, fixed k={gamma}  : {fixed['tok_s']:7.2f} tok/s decode (same engine, every "
          f"request drafting {gamma} tokens every step), "
          f"speedup {fixed['tok_s'] / statistics.median(plain['round_tok_s']):.2f}x "
          "(against plain's median)")
    s = tri["triforce"]
    print(f"TriForce levels: {format_snapshot(s)}")
    _explain(s, speedup)
    m = tri["metrics"]
    drafts = m.get("vllm:spec_decode_num_draft_tokens") or 0
    accepted = m.get("vllm:spec_decode_num_accepted_tokens") or 0
    print(f"vLLM spec-decode counters (controller run and its warm-up): {accepted}/{drafts} "
          "draft tokens accepted")
    same = (plain["tokens"] == tri["tokens"] == fixed["tokens"]
            and plain["same_each_round"] and tri["same_each_round"])
    print(f"outputs identical to plain vLLM: {'YES' if same else 'NO'} (drafts verified by "
          f"vLLM, proposed / accepted: controller {_drafts(s)}, fixed k={gamma} "
          f"{_drafts(fixed['triforce'])})")
    print(f"first continuation: {tri['text'][:200]!r}")


def _drafts(counts: dict) -> str:
    """`proposed / accepted` at the top level, and at the middle level if the small draft
    proposed."""
    text = f"{counts['top_proposed']} / {counts['top_accepted']}"
    if counts["middle_proposed"]:
        text += (f" (small draft to middle level {counts['middle_proposed']} / "
                 f"{counts['middle_accepted']})")
    return text


def _explain(s: dict, speedup: float) -> None:
    """What the depth controller chose, and why, in one or two lines."""
    steps = s["plain_steps"] + s["drafting_steps"]
    hist = ", ".join(f"depth {k}: {n}" for k, n in enumerate(s["depth_counts"]) if n)
    print(f"depth controller: {hist} (request-steps); {s['plain_steps']} of {steps} steps "
          f"plain; its model predicted {s['predicted_tokens_per_s']:.1f} tok/s, achieved "
          f"{s['achieved_tokens_per_s']:.1f}")
    if speedup < 1.0:
        print("TriForce is not faster than plain vLLM at this size on this machine: on a CPU, "
              "vLLM's attention verifies k drafts for 2-4 decode steps' price "
              "(benchmarks/explore/cpu_attention_cost.py) and each middle round reads all the "
              "weights, so drafting costs about what it saves; it pays where the KV cache "
              "outweighs the weights many times over (a larger --batch or --prompt-tokens, "
              "with VLLM_CPU_KVCACHE_SPACE in GiB raised to hold them), "
              "and on GPUs, whose attention verifies k tokens for about a step's price.")


def _verdict(v: dict) -> str:
    if v["identical"]:
        return f"identical ({v['sequences']} sequences)"
    where = ", ".join(f"seq {d['sequence']} at {d['position']} (plain margin "
                      f"{d['plain_margin']:.4f})" if d["plain_margin"] is not None else
                      f"seq {d['sequence']} at {d['position']} (no margin)"
                      for d in v["divergences"])
    return (f"{len(v['divergences'])} of {v['sequences']} sequences diverge: {where}; "
            f"{'all at near-ties' if v['explained'] else 'NOT ALL AT NEAR-TIES'}")


def step_costs(run: dict, new_tokens: int) -> dict:
    """Where one TriForce decode's time went, from its own counters: per vLLM step, the
    proposer's share (middle rounds, selection, bookkeeping) and the rest (vLLM's
    verification pass, sampling, scheduling); per middle round, the model forward's share;
    the tokens each request gained per step (`new_tokens`: per request)."""
    c = run["triforce"]
    steps = c["plain_steps"] + c["drafting_steps"]
    decode_ms, proposer_ms = 1000 * run["decode_s"], 1000 * c["middle_seconds"]
    rounds = c["middle_rounds"]
    return {"steps": steps, "tokens_per_step": new_tokens / steps if steps else None,
            "ms_per_step": decode_ms / steps if steps else None,
            "proposer_ms_per_step": proposer_ms / steps if steps else None,
            "vllm_ms_per_step": (decode_ms - proposer_ms) / steps if steps else None,
            "middle_rounds_per_step": rounds / steps if steps else None,
            "ms_per_middle_round": proposer_ms / rounds if rounds else None,
            "forward_ms_per_middle_round": 1000 * c["forward_seconds"] / rounds if rounds
            else None}


def _machine() -> dict:
    import platform

    import torch
    import vllm

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "cpu": platform.processor() or
            platform.machine(), "vllm": vllm.__version__, "torch": torch.__version__,
            "commit": os.environ.get("VLLM_TRIFORCE_COMMIT")}


def _run_rows(runs: list[dict], args) -> list[dict]:
    rows = []
    for r in runs:
        row = {"tok_s": r["tok_s"], "decode_s": r["decode_s"]}
        if "triforce" in r:
            c = r["triforce"]
            row.update({k: c[k] for k in DRAFT_COUNTS}, depth_counts=c["depth_counts"],
                       costs=step_costs(r, args.max_tokens))
        rows.append(row)
    return rows


def _save_rounds(args, rounds: dict, modes: dict) -> None:
    """The rounds so far (a run cut short keeps what it measured)."""
    data = {"machine": _machine(), "args": vars(args) | {"func": None}, "engines": modes,
            "rounds": {name: _run_rows(runs, args) for name, runs in rounds.items()},
            "complete": False}
    _write_json(args.out, data)


def _save(args, plain, tri, fixed, verdict, fixed_verdict) -> None:
    ratios = [t / p for t, p in zip(tri["round_tok_s"], plain["round_tok_s"])]
    fixed_ratios = [t / p for t, p in zip(fixed["round_tok_s"], plain["round_tok_s"])]
    m = tri["metrics"]
    data = {"machine": _machine(), "args": vars(args) | {"func": None},
            "engines": {"plain": plain["engine"], "triforce": tri["engine"]},
            "plain_tok_s": plain["round_tok_s"], "triforce_tok_s": tri["round_tok_s"],
            "fixed_tok_s": fixed["round_tok_s"],
            "speedup": {"rounds": ratios, "median": statistics.median(ratios)},
            "fixed_speedup": {"rounds": fixed_ratios, "median": statistics.median(fixed_ratios)},
            "plain_ms_per_step": [1000 * args.batch / t for t in plain["round_tok_s"]],
            # cumulative over the TriForce engine's runs (warm-up, controller and fixed)
            "vllm_counters": {"drafted": m.get("vllm:spec_decode_num_draft_tokens"),
                              "accepted": m.get("vllm:spec_decode_num_accepted_tokens")},
            "controller": {k: tri["triforce"][k] for k in (*DRAFT_COUNTS, "depth_counts",
                                                            "plain_steps", "drafting_steps")},
            "fixed": {k: fixed["triforce"][k] for k in (*DRAFT_COUNTS, "depth_counts")},
            "rounds": {"triforce": _run_rows(tri["rounds"], args),
                       "fixed": _run_rows(fixed["rounds"], args)},
            "verdict": verdict, "fixed_verdict": fixed_verdict,
            "same_each_round": {"plain": plain["same_each_round"],
                                "triforce": tri["same_each_round"]},
            "eager_check": fixed.get("eager_check"),
            "first_continuation": tri["text"][:300], "complete": True}
    _write_json(args.out, data)


def _write_json(path, data) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def _ms(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown(data: dict) -> str:
    """results.md of a demo run saved with `--out` (its results.json)."""
    m, a = data["machine"], data["args"]
    rounds = lambda xs: ", ".join(f"{x:.0f}" for x in xs)  # noqa: E731
    ratios = lambda s: ", ".join(f"{x:.2f}x" for x in s["rounds"])  # noqa: E731
    lines = [
        f"# TriForce against plain vLLM on a real model: {a['batch']} x {a['prompt_tokens']} "
        f"Moby-Dick tokens, {a['max_tokens']} new, greedy",
        "",
        f"{m['date']}, {m['gpu'] or m['cpu']}; vLLM {m['vllm']}, torch {m['torch']}, commit "
        f"{m['commit']}. `vllm-triforce demo --device {a['device']} --out results.json"
        f"{' --eager-check' if a.get('eager_check') else ''}`: SmolLM2-135M in {a['dtype']}, "
        f"TriForce two levels, retrieval budget {a['budget']}, gamma {a['gamma']}. Engines: "
        f"plain {data['engines']['plain']['mode']} with vLLM's defaults, TriForce "
        f"{data['engines']['triforce']['mode']} with its forced settings.",
        "",
        "| engine | decode tok/s per round | speedup per round | median |",
        "|---|---|---|---|",
        f"| plain vLLM (defaults) | {rounds(data['plain_tok_s'])} | | |",
        f"| TriForce, depth controller | {rounds(data['triforce_tok_s'])} | "
        f"{ratios(data['speedup'])} | {data['speedup']['median']:.2f}x |",
        f"| TriForce, fixed depth {a['gamma']} | {rounds(data['fixed_tok_s'])} | "
        f"{ratios(data['fixed_speedup'])} | {data['fixed_speedup']['median']:.2f}x |",
        "",
    ]
    for name, key in (("controller", "verdict"), (f"fixed depth {a['gamma']}", "fixed_verdict")):
        lines.append(f"- Outputs against plain vLLM, {name}: {_verdict(data[key])}.")
    c, f = data["controller"], data["fixed"]
    lines += [
        f"- Drafts verified by vLLM (proposed / accepted): controller {c['top_proposed']} / "
        f"{c['top_accepted']}, fixed depth {f['top_proposed']} / {f['top_accepted']} "
        f"(acceptance {f['top_accepted'] / max(f['top_proposed'], 1):.3f}); vLLM's own "
        f"counters over the TriForce engine: {data['vllm_counters']['accepted']} / "
        f"{data['vllm_counters']['drafted']} accepted.",
        f"- Depth controller: {c['plain_steps']} of {c['plain_steps'] + c['drafting_steps']} "
        "steps plain; request-steps by depth "
        + ", ".join(f"{k}: {n}" for k, n in enumerate(c["depth_counts"]) if n) + ".",
    ]
    if data.get("eager_check"):
        e = data["eager_check"]
        lines.append(f"- CUDA graphs and the capture: fixed-depth acceptance compiled "
                     f"{e['compiled_acceptance']:.3f}, eager {e['eager_acceptance']:.3f} "
                     f"({'within' if e['agree'] else 'NOT within'} 3 points).")
    lines += ["", "Where a step's time goes (per round, from TriForce's counters; plain vLLM: "
              + ", ".join(f"{x:.2f}" for x in data["plain_ms_per_step"]) + " ms per step):", "",
              "| run | ms per step | tokens per request per step | proposer ms | vLLM ms "
              "| middle rounds per step | ms per middle round | of which model forward |",
              "|---|---|---|---|---|---|---|---|"]
    for name in ("triforce", "fixed"):
        for row in data["rounds"][name]:
            k = row["costs"]
            lines.append(f"| {'controller' if name == 'triforce' else 'fixed'} | "
                         f"{_ms(k['ms_per_step'])} | {_ms(k['tokens_per_step'])} | "
                         f"{_ms(k['proposer_ms_per_step'])} | {_ms(k['vllm_ms_per_step'])} | "
                         f"{_ms(k['middle_rounds_per_step'])} | {_ms(k['ms_per_middle_round'])}"
                         f" | {_ms(k['forward_ms_per_middle_round'])} |")
    return "\n".join(lines) + "\n"
