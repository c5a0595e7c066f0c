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


def add_demo_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="TriForce vs plain vLLM on a long book prompt")
    p.add_argument("--prompt-tokens", type=int, default=7936, help="tokens per prompt")
    p.add_argument("--max-tokens", type=int, default=96, help="new tokens per request")
    p.add_argument("--batch", type=int, default=4, help="requests (different book passages)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of one timed decode per engine (the speedup of each round and "
                        "their median)")
    p.add_argument("--budget", type=int, default=512, help="retrieval_budget (tokens)")
    p.add_argument("--gamma", type=int, default=6, help="num_speculative_tokens (gamma2)")
    p.add_argument("--three-level", action="store_true",
                   help="Qwen2.5-Coder-1.5B target + Qwen2.5-Coder-0.5B draft")
    p.add_argument("--dtype", default="float32", help="model dtype (float32 = exact comparison)")
    p.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
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
    print(_openmp_line(os.environ.get("LD_PRELOAD", "")), flush=True)
    plain, tri, fixed = _run(target, spec, prompts, args)
    _report(plain, tri, fixed, args.gamma)
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
    which the two engines decode in turn. vLLM keeps one engine's parallel state per
    process, so each engine lives in a child process of its own (`_engine_process`), both
    alive for the whole run, each decoding when told."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    engines = {}
    rounds = {"plain": [], "triforce": []}
    try:
        for name, engine_spec in (("plain", None), ("triforce", spec)):
            parent, child = context.Pipe()
            proc = context.Process(target=_engine_process,
                                   args=(child, model_dir, engine_spec, prompts, args))
            proc.start()
            engines[name] = (proc, parent)
            _ask(parent, "ready")  # one prefill at a time: the two would share the cores
        for i in range(max(args.rounds, 1)):
            for name in (list(engines) if i % 2 == 0 else list(reversed(engines))):
                rounds[name].append(_ask(engines[name][1], "decode"))
        plain, tri = ({**r[-1], "round_tok_s": [x["tok_s"] for x in r],
                       "same_each_round": all(x["tokens"] == r[0]["tokens"] for x in r)}
                      for r in rounds.values())
        fixed = _ask(engines["triforce"][1], "fixed")
        tri["triforce"] = fixed.pop("counts_before")  # the controller's run and its warm-up
    finally:
        for proc, conn in engines.values():
            try:
                conn.send("quit")
            except OSError:  # it already went
                pass
            proc.join(timeout=60)
            conn.close()
            if proc.is_alive():
                proc.kill()
    return plain, tri, fixed


def _ask(conn, command: str):
    conn.send(command)
    status, value = conn.recv()
    if status != "ok":
        raise RuntimeError(f"demo engine process failed on {command!r}:\n{value}")
    return value


def _engine_process(conn, model_dir, spec, prompts, args) -> None:
    """One engine in this child process (ENGINE_ENV comes with the parent's environment):
    built and prefilled before the first answer (`ready`), then per command one timed decode
    (`decode`), or one at the full depth (`fixed`: with its own draft counts and TriForce's
    counts before it), until `quit` or the parent goes."""
    import traceback

    try:
        llm, prefill_s = _engine(model_dir, spec, prompts, args)
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        while True:
            command, reply = conn.recv(), None
            if command == "quit":
                break
            if command == "decode":
                reply = _decode(llm, prompts, params, prefill_s)
            elif command == "fixed":
                drafter = drafter_of(llm)
                before = drafter.stats.snapshot()
                drafter.depth.controller.forced = [args.gamma]
                reply = _decode(llm, prompts, params, prefill_s)
                after = drafter.stats.snapshot()  # the fixed run's own: after minus before
                reply["triforce"] = {k: after[k] - before[k] for k in DRAFT_COUNTS}
                reply["counts_before"] = before
            conn.send(("ok", reply))  # `ready`: the prefill above is done
        free_llm(llm)
    except EOFError:  # the parent went away
        pass
    except Exception:  # noqa: BLE001 -- reported to the parent, which raises it
        conn.send(("error", traceback.format_exc()))


def _engine(model_dir, spec, prompts, args):
    """(LLM, prefill seconds): the engine, its prompts prefilled with 1 token, so the
    prefix cache keeps their KV and each timed decode's prefill is a prefix-cache hit."""
    from vllm import LLM, SamplingParams

    max_len = args.prompt_tokens + args.max_tokens + 2 * args.gamma + 64
    llm = LLM(str(model_dir), dtype=args.dtype, enforce_eager=True, block_size=32, seed=0,
              max_model_len=max_len, speculative_config=spec, disable_log_stats=False)
    prefill = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, prefill, use_tqdm=False)
    return llm, time.perf_counter() - start


DRAFT_COUNTS = ("top_proposed", "top_accepted", "middle_proposed", "middle_accepted")


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
