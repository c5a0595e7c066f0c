"""`vllm-triforce demo`: TriForce against plain vLLM on long Moby-Dick prompts.

Runs the same greedy requests on a plain engine and on a TriForce engine, each in a child
process of its own (demo_engine.py) and both alive for the whole run: after each engine's
prefill, `--rounds` rounds in which each engine decodes once, the two in turn (which goes
first alternates), so a host whose speed drifts over minutes slows both alike; then the
TriForce engine once more with every request at the full depth, which proves drafting:
an engine that never drafted decodes plainly and equals plain vLLM trivially, so the demo
fails (exit 1) if that run drafted nothing. The terminal gets one line per phase (with
about how long it takes) and one table; vLLM's own log goes to a file the demo names.
`--state-dir DIR` runs the engines one after another instead, each engine's results kept in
DIR as its part ends: the same command again resumes at the first part without results (a
lent GPU's call cap cut the real-model run on a cold machine), and plain vLLM's part serves
every TriForce variant of the same requests.

Devices (`--device auto`: a GPU when torch sees one):
* CPU: SmolLM2-135M in float32 (exact comparison), eager, 8 x 4,096 tokens, 96 new: about
  five minutes on a 2-core machine, half of it the two prefills. Both engines start with
  Intel OpenMP preloaded, as vLLM's CPU installation guide sets up (`cpu_openmp`).
* GPU: SmolLM2-135M in bf16, 32 x 7,808 tokens (the KV cache 22x the weights), 256 new; the
  plain engine runs vLLM's own defaults, TriForce its forced settings. With `--out` the
  fixed-depth decode runs in every round, plain vLLM decodes once more for its top-2
  log-prob margins (a bf16 divergence must sit at a near-tie), and the results go to a
  JSON file after every round (demo_results.py; benchmarks/gpu/).
`--three-level`: Qwen2.5-Coder-1.5B target with the Qwen2.5-Coder-0.5B draft (fetches
~1.6 GB of packages the first time).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from vllm_triforce.tools.cpu_openmp import named_runtime, with_intel_openmp
from vllm_triforce.tools.demo_engine import engine_process, sum_counts
from vllm_triforce.tools.demo_results import (acceptance, report, save_results, save_rounds,
                                                 write_json)

# Each of the two engines gets 2 GiB of KV cache on CPU: 4 x 8K SmolLM2 tokens in fp32
# need 1.4.
ENGINE_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
# Engines on an NVIDIA GPU: vLLM's own defaults for the plain engine (compiled, CUDA graphs,
# V2 model runner, async scheduling), TriForce's forced settings for its own; in-process
# engines (vllm_triforce/offline.py: the TriForce engine's counters are read from its
# proposer), no CPU variables.
GPU_ENGINE_ENV = {"HF_HUB_OFFLINE": "1"}
# What each device runs unless told otherwise. CPU: 8 x 4,096 tokens in float32, whose KV
# cache (1.4 GiB) outweighs the weights and whose two prefills take a few minutes of a
# 2-core machine. GPU: 32 x 7,808 tokens in bf16, where
# the KV cache (5.5 GiB) is 22x the weights; 7,808 + 256 new tokens + the drafting margin
# fit SmolLM2's 8,192-token context.
DEVICE_DEFAULTS = {
    "cpu": {"prompt_tokens": 4096, "max_tokens": 96, "batch": 8, "dtype": "float32"},
    "cuda": {"prompt_tokens": 7808, "max_tokens": 256, "batch": 32, "dtype": "bfloat16"},
}
# Seconds a SmolLM2-135M float32 prefill of one L-token prompt takes on a 2-core AMD EPYC
# with vLLM's CPU attention: about C1 * L + C2 * L^2 (fitted to 512 and 4,096 tokens), for
# the first phase's estimate; later phases are estimated from what was measured.
PREFILL_C1, PREFILL_C2 = 1.25e-3, 2.3e-7
ENGINE_START_S = 30  # a CPU engine's start (vLLM import, weights, warm-up), about


def add_demo_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="TriForce vs plain vLLM on a long book prompt")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: an NVIDIA GPU when torch sees one, else the CPU")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="tokens per prompt (default: 4,096 on CPU, 7,808 on a GPU)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="new tokens per request (default: 96 on CPU, 256 on a GPU)")
    p.add_argument("--batch", type=int, default=None,
                   help="requests, different book passages (default: 8 on CPU, 32 on a GPU)")
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
    p.add_argument("--log", default=None,
                   help="where vLLM's log goes (default: a new file in the temp folder)")
    p.add_argument("--out", default=None,
                   help="the results as JSON, written after every round (default: beside the "
                        "log, .json)")
    p.add_argument("--round-graphs", action="store_true",
                   help="TriForce's middle passes over persistent buffers, as CUDA graphs on "
                        "a GPU (speculative_config['round_graphs'], off by default)")
    p.add_argument("--compiled-selection", action="store_true",
                   help="TriForce's block scores, re-ranking and pass layout compiled "
                        "(speculative_config['compiled_selection'], off by default)")
    p.add_argument("--selection-graphs", action="store_true",
                   help="with both above: a middle round's re-selection and the next pass's "
                        "load as one graph (speculative_config['selection_graphs'], off by "
                        "default)")
    p.add_argument("--eager-check", action="store_true",
                   help="after the rounds, the fixed-depth decode once more on an eager "
                        "TriForce engine: its acceptance must match the compiled engine's "
                        "(within 3 points), or CUDA graphs changed what TriForce reads")
    p.add_argument("--state-dir", default=None,
                   help="the engines one after another, not side by side, each engine's "
                        "results kept in this folder once its rounds are done; the same "
                        "command again resumes at the first engine without results there "
                        "(for a run that a time limit may cut, such as a lent GPU's call)")
    p.set_defaults(func=run_demo)


def resolve_device(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with the device decided, every size left unset taken from it, and the log
    file named."""
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    for key, value in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.log is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        args.log = os.path.join(tempfile.gettempdir(), f"vllm-triforce-demo-{stamp}.log")
    if args.out is None:  # the results beside the log
        args.out = os.path.splitext(args.log)[0] + ".json"
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
    if args.round_graphs:
        spec["round_graphs"] = True
    if args.compiled_selection:
        spec["compiled_selection"] = True
    if args.selection_graphs:
        spec["selection_graphs"] = True
    prompts = _book_prompts(target, args.prompt_tokens, args.batch)
    where = "a GPU" if args.device == "cuda" else f"this CPU ({os.cpu_count()} cores)"
    print(f"TriForce against plain vLLM: {target.name} ({args.dtype}) on {where}, "
          f"{args.batch} x {args.prompt_tokens:,}-token Moby-Dick passages, {args.max_tokens} "
          f"new tokens each, greedy; TriForce {'three' if draft else 'two'} levels, retrieval "
          f"budget {args.budget}, up to {args.gamma} drafts a step.", flush=True)
    print(_regime(target, args), flush=True)
    if args.device == "cpu":
        print(_openmp_line(os.environ.get("LD_PRELOAD", "")), flush=True)
    print(f"vLLM's log: {args.log}; results: {args.out}", flush=True)
    if args.state_dir:
        print(f"The engines run one after another, each engine's results kept in "
              f"{args.state_dir} (--state-dir): its rounds are not interleaved with the "
              "other's.", flush=True)
    clock = Clock(_first_estimate(target, args))
    plain, tri, fixed = _run(target, spec, prompts, args, clock)
    report(plain, tri, fixed, args)
    if not fixed["triforce"]["top_proposed"]:
        print(f"\nERROR: TriForce drafted nothing in the fixed k={args.gamma} run: no draft "
              "reached vLLM's verification, so the identity above proves nothing.",
              file=sys.stderr, flush=True)
        return 1
    return save_results(args, plain, tri, fixed)


class Clock:
    """The demo's progress lines: `[m:ss] what (about how long) ... done in N s`."""

    def __init__(self, engine_estimate_s: float | None):
        self.start = time.monotonic()
        self.engine_estimate_s = engine_estimate_s  # the first engine's start and prefill
        self.round_estimate_s: float | None = None

    def begin(self, what: str, estimate_s: float | None) -> float:
        about = f" (about {_duration(estimate_s)})" if estimate_s else ""
        print(f"[{_duration(time.monotonic() - self.start, clock=True)}] {what}{about} ...",
              end="", flush=True)
        return time.monotonic()

    def end(self, began: float, result: str = "") -> float:
        took = time.monotonic() - began
        print(f" {result + ', ' if result else ''}{_duration(took)}", flush=True)
        return took


def _duration(seconds: float, clock: bool = False) -> str:
    s = int(round(seconds))
    if clock:
        return f"{s // 60}:{s % 60:02d}"
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60:02d} s"


def _first_estimate(model_dir, args) -> float | None:
    """The first engine's start and prefill, on CPU (PREFILL_C1/C2, scaled by the
    model's size against SmolLM2-135M's); None on a GPU."""
    if args.device != "cpu":
        return None
    length = args.prompt_tokens
    per_request = PREFILL_C1 * length + PREFILL_C2 * length ** 2
    scale = _num_params(model_dir) / 135e6
    return ENGINE_START_S + args.batch * per_request * scale


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


def _run(model_dir, spec, prompts, args, clock: Clock):
    """(plain, TriForce with its depth controller, the same TriForce engine with every
    request forced to the full depth: fixed-gamma TriForce). Each engine in a child process
    of its own, both alive for the whole run, each decoding when told; `args.rounds` rounds
    in which the two decode in turn, the results saved after each. On a GPU the fixed-depth
    decode runs in every round, right after the controller's, and plain vLLM decodes once
    more, untimed, for its top-2 log-prob margins (a bf16 verdict); on CPU it runs once,
    after the rounds (float32 outputs must be identical). With `--state-dir` the engines
    run one after another instead (`_run_in_turn`)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    if args.state_dir:
        return _run_in_turn(context, model_dir, spec, prompts, args, clock)
    engines, modes = {}, {}
    rounds = {"plain": [], "triforce": [], "fixed": []}
    every_round = args.device == "cuda"
    estimate = clock.engine_estimate_s
    margins = None
    try:
        for name, engine_spec in (("plain", None), ("triforce", spec)):
            # one prefill at a time: the two would share the device
            proc, conn, modes[name], estimate = _start_timed(
                context, model_dir, engine_spec, prompts, args, clock, estimate)
            engines[name] = (proc, conn)
        for i in range(max(args.rounds, 1)):
            began = clock.begin(f"round {i + 1} of {args.rounds}", clock.round_estimate_s)
            for name in (list(engines) if i % 2 == 0 else list(reversed(engines))):
                rounds[name].append(_ask(engines[name][1], "decode"))
                if name == "triforce" and every_round:
                    rounds["fixed"].append(_ask(engines[name][1], "fixed"))
            plain_tok_s, tri_tok_s = rounds["plain"][-1]["tok_s"], rounds["triforce"][-1]["tok_s"]
            clock.round_estimate_s = clock.end(
                began, f"plain {plain_tok_s:.1f} tok/s, TriForce {tri_tok_s:.1f} tok/s: "
                       f"{tri_tok_s / plain_tok_s:.2f}x")
            save_rounds(args, rounds, modes)
        if not every_round:
            rounds["fixed"].append(_fixed_once(engines["triforce"][1], args, clock))
        else:
            margins = _ask(engines["plain"][1], "margins")
    finally:
        for proc, conn in engines.values():
            _stop(proc, conn)
    plain, tri, fixed = _combine(rounds, modes, margins)
    if args.eager_check:
        fixed["eager_check"] = _eager_check(context, model_dir, spec, prompts, args, fixed)
    return plain, tri, fixed


def _run_in_turn(context, model_dir, spec, prompts, args, clock: Clock):
    """`_run`'s results with the engines one after another (`--state-dir`): plain vLLM
    alone for its rounds (on a GPU, then its margins), stopped; then TriForce alone for
    its rounds (the fixed-depth decode as `_run` runs it); then the eager check. Each
    part's results go to the state folder as it ends, named by what decides them
    (`_state_keys`), and a part whose results are there is not run again: a run cut by a
    time limit resumes where it was, and plain vLLM's results serve every TriForce
    variant of the same requests."""
    state = Path(args.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    keys = _state_keys(model_dir, spec, prompts, args)
    rounds = {"plain": [], "triforce": [], "fixed": []}
    modes, margins = {}, None
    estimate = clock.engine_estimate_s
    for name, engine_spec in (("plain", None), ("triforce", spec)):
        path = state / f"{name}-{keys[name]}.json"
        if path.is_file():
            part = json.loads(path.read_text())
            print(f"{'plain vLLM' if engine_spec is None else 'TriForce'}: "
                  f"{len(part['decode'])} rounds from {path}", flush=True)
        else:
            part = _engine_alone(context, model_dir, engine_spec, prompts, args, clock,
                                 estimate, rounds, modes)
            write_json(path, part)
            estimate = part["engine"]["start_s"]
        modes[name], rounds[name] = part["engine"], part["decode"]
        if engine_spec is None:
            margins = part.get("margins")
        else:
            rounds["fixed"] = part["fixed"]
        save_rounds(args, rounds, modes)
    plain, tri, fixed = _combine(rounds, modes, margins)
    if args.eager_check:
        path = state / f"eager-{keys['triforce']}.json"
        eager = json.loads(path.read_text()) if path.is_file() else None
        if eager is not None:
            print(f"eager TriForce: its fixed-depth decode from {path}", flush=True)
        fixed["eager_check"] = _eager_check(context, model_dir, spec, prompts, args, fixed,
                                            eager=eager, save_to=path)
    return plain, tri, fixed


def _engine_alone(context, model_dir, spec, prompts, args, clock: Clock, estimate, rounds,
                  modes) -> dict:
    """One engine started, its `args.rounds` timed decodes (TriForce's: with the
    fixed-depth decode as `_run` runs it), on a GPU plain vLLM's margins, then stopped:
    {"engine", "decode", "fixed", "margins"}. `rounds` and `modes` get each result as it
    comes (the results file keeps a cut run's rounds)."""
    name = "plain" if spec is None else "triforce"
    label = "plain vLLM" if spec is None else "TriForce"
    proc, conn, mode, took = _start_timed(context, model_dir, spec, prompts, args, clock,
                                          estimate)
    part = {"engine": {**mode, "start_s": took}, "decode": [], "fixed": []}
    modes[name] = part["engine"]
    every_round = args.device == "cuda"
    try:
        for i in range(max(args.rounds, 1)):
            began = clock.begin(f"{label}: round {i + 1} of {args.rounds}",
                                clock.round_estimate_s)
            part["decode"].append(_ask(conn, "decode"))
            rounds[name].append(part["decode"][-1])
            if spec is not None and every_round:
                part["fixed"].append(_ask(conn, "fixed"))
                rounds["fixed"].append(part["fixed"][-1])
            clock.round_estimate_s = clock.end(began, f"{part['decode'][-1]['tok_s']:.1f} tok/s")
            save_rounds(args, rounds, modes)
        if spec is not None and not every_round:
            part["fixed"].append(_fixed_once(conn, args, clock))
        if spec is None and every_round:
            part["margins"] = _ask(conn, "margins")
    finally:
        _stop(proc, conn)
    return part


def _state_keys(model_dir, spec, prompts, args) -> dict:
    """{"plain", "triforce"}: a short hash of what decides each engine's results in
    `--state-dir` (the requests, the sizes, the device, this code's commit; TriForce's
    also its speculative config)."""
    import hashlib

    from vllm_triforce.tools.demo_results import source_commit

    common = {"model": Path(model_dir).name, "commit": source_commit(),
              "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
              **{key: getattr(args, key) for key in (
                  "device", "dtype", "prompt_tokens", "batch", "max_tokens", "rounds", "gamma",
                  "gpu_memory_utilization")}}
    digest = lambda d: hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]  # noqa: E731
    return {"plain": digest(common), "triforce": digest({**common, "spec": spec})}


def _start_timed(context, model_dir, spec, prompts, args, clock: Clock, estimate):
    """`_start` with its progress line: (process, connection, how the engine runs, seconds
    it took)."""
    label = "plain vLLM" if spec is None else "TriForce"
    began = clock.begin(f"{label}: starting, and prefilling {args.batch} x "
                        f"{args.prompt_tokens:,} tokens", estimate)
    proc, conn, mode = _start(context, model_dir, spec, prompts, args)
    return proc, conn, mode, clock.end(began, f"prefill {mode['prefill_s']:.0f} s")


def _fixed_once(conn, args, clock: Clock) -> dict:
    """On CPU, after the rounds: TriForce's decode at the full depth, once."""
    began = clock.begin(f"TriForce at fixed depth {args.gamma}: every request drafting "
                        "every step", 1.5 * (clock.round_estimate_s or 0) or None)
    run = _ask(conn, "fixed")
    clock.end(began, f"{run['tok_s']:.1f} tok/s")
    return run


def _combine(rounds: dict, modes: dict, margins) -> tuple[dict, dict, dict]:
    """(plain, tri, fixed) from each engine's rounds: the last round's outputs, every
    round's tok/s, whether each round gave the same tokens, TriForce's counters summed."""
    plain, tri = ({**r[-1], "round_tok_s": [x["tok_s"] for x in r],
                   "same_each_round": all(x["tokens"] == r[0]["tokens"] for x in r)}
                  for r in (rounds["plain"], rounds["triforce"]))
    plain["engine"], tri["engine"] = modes["plain"], modes["triforce"]
    if margins is not None:
        plain["margins"] = margins
    fixed = {**rounds["fixed"][-1], "round_tok_s": [x["tok_s"] for x in rounds["fixed"]],
             "triforce": sum_counts([x["triforce"] for x in rounds["fixed"]])}
    tri["triforce"] = sum_counts([x["triforce"] for x in rounds["triforce"]])
    tri["rounds"], fixed["rounds"] = rounds["triforce"], rounds["fixed"]
    return plain, tri, fixed


def _eager_check(context, model_dir, spec, prompts, args, fixed, eager: dict | None = None,
                 save_to: Path | None = None) -> dict:
    """The fixed-depth decode on an eager TriForce engine, against the compiled engine's
    (`fixed`, all rounds): acceptance within 3 points, and the same tokens. `eager`: that
    decode already run (`--state-dir`), else it runs now (and goes to `save_to`)."""
    if eager is None:
        proc, conn, _ = _start(context, model_dir, spec, prompts, args, eager_only=True)
        try:
            eager = _ask(conn, "fixed")
        finally:
            _stop(proc, conn)
        if save_to is not None:
            write_json(save_to, eager)
    compiled, eager_rate = acceptance(fixed["triforce"]), acceptance(eager["triforce"])
    agree = (compiled is not None and eager_rate is not None
             and abs(compiled - eager_rate) <= 0.03)
    print(f"capture check: fixed-depth acceptance compiled {compiled:.3f} "
          f"({fixed['triforce']['top_accepted']}/{fixed['triforce']['top_proposed']}), eager "
          f"{eager_rate:.3f} ({eager['triforce']['top_accepted']}/"
          f"{eager['triforce']['top_proposed']}): {'agree' if agree else 'DIFFER'} within 3 "
          f"points; tokens {'equal' if eager['tokens'] == fixed['tokens'] else 'differ'}",
          flush=True)
    return {"compiled_acceptance": compiled, "eager_acceptance": eager_rate, "agree": agree,
            "eager_counts": {k: eager["triforce"][k] for k in
                             ("top_proposed", "top_accepted", "middle_proposed",
                              "middle_accepted")},
            "same_tokens": eager["tokens"] == fixed["tokens"]}


def _start(context, model_dir, spec, prompts, args, eager_only: bool = False):
    """(process, connection, how the engine runs) of one engine, built and prefilled. On a
    GPU an engine that fails to start compiled (torch.compile, CUDA graphs) is started
    again eager, and says so: its numbers are then eager ones."""
    attempts = (False, True) if args.device == "cuda" and not eager_only else (True,)
    for eager in attempts:
        parent, child = context.Pipe()
        proc = context.Process(target=engine_process,
                               args=(child, model_dir, spec, prompts, args, eager))
        proc.start()
        try:
            return proc, parent, _ask(parent, "ready")
        except RuntimeError as err:
            _stop(proc, parent)
            if eager:
                raise
            last = str(err).strip().splitlines()[-1]
            print(f"\n{'TriForce' if spec else 'plain'} engine failed to start compiled "
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
    budget_kv = kv * min(args.budget / (args.prompt_tokens + args.max_tokens), 1.0)
    share = (weights + budget_kv) / (weights + kv)
    return (f"KV cache {kv / 2**30:.2f} GiB against weights {weights / 2**30:.2f} GiB "
            f"({args.dtype}): a plain step reads both, a middle round the weights and a "
            f"{args.budget}-token retrieval cache, {share:.0%} of those bytes; drafting pays "
            "where that share is small and verifying k drafts costs about one step.")
