"""Round graphs on a GPU (issue 59): are the graphed middle passes the passes they replace,
and what does a middle round cost with them?

TriForce's middle passes over persistent buffers (`round_graphs: true`,
engine/device/round_graph.py) replay as CUDA graphs on FLASH_ATTN and TRITON_ATTN, and
eagerly over the same buffers on a CPU, where the tests hold them to today's path. What
only a GPU can show, in three parts, most valuable first:

(a) Correctness, a tiny random 4-layer Llama (gpu_models.build_tiny_pair), FLASH_ATTN bf16,
    compiled, fixed depth 4, two levels and three. Every middle round's pass also runs
    today's way first (`forward.run_pass`, same inputs and tables) and the graph's logits
    and captured queries are held against it (max |delta|, argmax agreement): a graph that
    froze a stale table, length or address shows here at once. Then the engine's greedy
    tokens against a plain vLLM engine's (with TriForce's forced settings: like with like;
    a bf16 divergence must sit where plain's top-2 margin is a near-tie,
    gpu_summary.compare_tokens), drafts verified (top_proposed > 0); syncs per middle round
    (tools/bench/syncs.py, and torch's sync debug mode); the same engine with its round
    graphs switched off (`drafter.retrieval.round_graphs = None`): the same tokens, and
    acceptance within a few points. With `selection_graphs` on, the rounds a selection
    graph loaded (`round_graph_selections`) and the steps' first passes it laid out
    (`round_graph_layouts`) are counted beside the rounds.
(b) Cost at Llama-3.1-8B's width (`--b-layers`, 8 by default: a pass's device time is about
    a quarter of the 32-layer model's, while the host's work per round is not, so a round's
    cost over its device time is if anything higher here), dummy weights, 8 x 7,680 tokens,
    depth 6: ms per middle round in five modes (`MODES`: the next one with each round's
    next pass replayed before the round's copy to the host is waited for,
    VLLM_TRIFORCE_LAUNCH_AHEAD=1; graphs with a round's
    re-selection and the next pass's load as one graph more, `selection_graphs`; graphs
    with the selection compiled, `compiled_selection`; graphs with the eager reads; per
    pass) in ONE engine,
    alternating twice (a drift of the machine shows as a difference between the two passes
    of each mode); the compiled and per-pass modes also with VLLM_TRIFORCE_TIME_FORWARDS=1
    (a sync per pass: the forwards' time as the device finishes them), and the graph
    replays' device time from CUDA events around their launches (no sync), and so the
    selection graphs' (`round_over_device`: a round over its pass's and its selection
    graph's device time, the issue's 1.3x with the selection as graphs); TriForce's CUDA
    memory (what `initialize_attn_backend` keeps, what each capture took, the peak above
    each `propose`'s entry) against its reservation (`drafter.reserved_bytes`).
(c) Cost at SmolLM2-135M's shape (dummy weights), 32 x 7,808 tokens: ms per middle round and
    per step at depths 6 (the five modes) and 0 (graphs and per pass) in one engine.
(t) (a)'s two levels on TRITON_ATTN in float32, the issue's other graphed backend: every
    round against today's path, and the graphs' tokens against the same engine's with
    them off, which in float32 must be identical (plain vLLM's tokens on TRITON_ATTN are
    gpu_plan's `exact-triton-fp32-*` rows). Last, as it repeats (a) on another backend.
Parts (a), (b) and (c) compile the selection (`compiled_selection`: block scores, re-ranking,
a pass's tables and slots, the lazy summaries' read of the KV cache; whether each compiled,
and in how long, is in each report) and run a round's re-selection and load as one graph
(`selection_graphs`; whether its capture held, in `compiled_selection`).

Each engine runs in a child process of its own: a CUDA error in a replay (an illegal
address, say) leaves its process's context unusable, and would take every later engine with
it. The parent runs the engines of `--parts` in order of value (`JOBS`), starts one only
when its first result fits what is left of `--budget-s`, stops one that outlasts it, and
writes `--out`/results.json after every engine (an engine's partial results too, and the
figures the issue asks for under "checks"); the engines' logs go to `--out`/jobs.log.

On a lent GPU, from the bundle (benchmarks/gpu/README.md; carry `.bundle`):

    bash scripts/gpu_session.sh round-graphs 420 a,b     # then, within 30 s:
    bash scripts/gpu_session.sh round-graphs 300 c,t

On a CPU, a smoke test of this script (tiny sizes, CPU_ATTN float32, eager):

    .venv/bin/python benchmarks/explore/gpu_round_graph.py --device cpu --out /tmp/rg --parts a
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from vllm_triforce.tools.bench.gpu_plan import COST_SPEC, FORCED_SETTINGS, TINY_SPEC

# The draft's keys in three levels (gpu_plan's exactness rows).
THREE_LEVELS = {"draft_window_tokens": 96, "draft_tokens_per_round": 2}
# SmolLM2-135M's config.json, written over Llama-3.1-8B's (every field that differs).
SMOLLM2_SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                 "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                 "vocab_size": 49152, "max_position_embeddings": 8192, "rope_theta": 100000.0,
                 "rope_scaling": None, "tie_word_embeddings": True, "bos_token_id": 1,
                 "eos_token_id": 2}
# On a CPU, parts b and c keep their model's family at a width two cores run in seconds.
CPU_WIDTH = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64}
# Sizes by device. a: prompts of shortest + i * step tokens (past TINY_SPEC's 256-token
# budget); b, c: batch x context, the short and long decode of a step's timing
# (tools/bench/step_timing.py).
SIZES = {
    "cuda": {"a": {"prompts": 4, "shortest": 600, "step": 100, "max_tokens": 48, "depth": 4,
                   "llm": {"dtype": "bfloat16", "block_size": 32, "max_model_len": 4096,
                           "gpu_memory_utilization": 0.3,
                           # 4 x 5 tokens verified a step: fewer graph sizes, a faster start
                           "compilation_config": {"max_cudagraph_capture_size": 32}}},
             "b": {"batch": 8, "context": 7680, "depth": 6, "decode": (8, 64), "over": {},
                   "budget": COST_SPEC["retrieval_budget"],
                   "llm": {"max_model_len": 8192, "max_num_seqs": 64}},
             "c": {"batch": 32, "context": 7808, "depths": (6, 0), "decode": (8, 64),
                   "over": {}, "budget": 512,
                   # 32 requests: vLLM's default of 1,024 only adds graph sizes to start
                   "llm": {"max_model_len": 8192, "max_num_seqs": 64}}},
    "cpu": {"a": {"prompts": 2, "shortest": 400, "step": 80, "max_tokens": 16, "depth": 4,
                  "llm": {"dtype": "float32", "block_size": 32, "max_model_len": 1024}},
            "b": {"batch": 2, "context": 1024, "depth": 6, "decode": (4, 12), "budget": 256,
                  "over": {**CPU_WIDTH, "num_hidden_layers": 2}, "llm": {"max_model_len": 2048}},
            "c": {"batch": 2, "context": 1024, "depths": (6, 0), "decode": (4, 12),
                  "budget": 256, "over": {"num_hidden_layers": 2},
                  "llm": {"max_model_len": 2048}}},
}
# (t): (a)'s sizes, TRITON_ATTN in float32 on a GPU (CPU_ATTN on a CPU, as (a))
SIZES["cuda"]["t"] = {**SIZES["cuda"]["a"],
                      "llm": {**SIZES["cuda"]["a"]["llm"], "dtype": "float32"}}
SIZES["cpu"]["t"] = SIZES["cpu"]["a"]
# (engine, part), in the order they run, most telling first: two levels against today's
# path, the 8B width's cost, three levels, then plain vLLM's tokens (the engines' own
# graphs-off generations already hold the graphs to today's path), SmolLM2's shape.
JOBS = (("a-2L", "a"), ("b", "b"), ("a-3L", "a"), ("a-plain", "a"), ("c", "c"), ("t-2L", "t"))
# Seconds an engine takes to its first saved result (start, prefill, first generation or
# row), from the H200 start-up times in benchmarks/gpu/README.md (a compiled engine in
# 70-110 s) and, on a CPU, this machine's: an engine is started only when that much of the
# budget is left; one cut short at the budget's end keeps what it saved.
FIRST_RESULT_S = {"cuda": {"a-2L": 80, "b": 110, "a-3L": 90, "a-plain": 80, "c": 110,
                           "t-2L": 80},
                  "cpu": {"a-2L": 30, "b": 30, "a-3L": 40, "a-plain": 40, "c": 30, "t-2L": 30}}
COUNTERS = ("top_proposed", "top_accepted", "middle_proposed", "middle_accepted",
            "middle_rounds", "middle_seconds", "forward_seconds", "round_graph_passes",
            "round_graph_misses", "round_graph_ahead", "round_graph_selections",
            "round_graph_layouts", "round_graph_launched_ahead", "refreshes", "plain_steps",
            "drafting_steps")
PER_ROUND_KEPT = 16  # rounds of (a) kept one by one in the results; all are summarised
TIME_FORWARDS = "VLLM_TRIFORCE_TIME_FORWARDS"
# How (b) and (c) run a middle round, in one engine: round graphs with the round's
# re-selection and the next pass's load as one graph more (`selection_graphs`, engine/
# device/selection_graph.py), round graphs with the shortlist re-ranked and the pass laid
# out by compiled functions (`compiled_selection`), round graphs with the eager chunked
# reads, and each pass built anew with the eager reads (today's default); first, the
# selection graphs' mode with each round's next pass replayed before the round's copy to
# the host is waited for (VLLM_TRIFORCE_LAUNCH_AHEAD=1, engine/retrieval_level.py
# `RetrievalStep.launch_ahead`)
AHEAD, FUSED, COMPILED, GRAPHS, PER_PASS = (
    "graphs, selection graphs, launched ahead", "graphs, selection graphs",
    "graphs, compiled selection", "graphs", "per pass")
MODES = (AHEAD, FUSED, COMPILED, GRAPHS, PER_PASS)
LAUNCH_AHEAD = "VLLM_TRIFORCE_LAUNCH_AHEAD"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--parts", default="a,b,c")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda when torch sees one")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start an engine only when its first result fits in what is "
                        "left of this many seconds; stop it at the end")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="a tokenizer folder (default: SmolLM2-135M's from the model cache)")
    p.add_argument("--work", type=Path, default=Path("/tmp/vt-round-graph"))
    p.add_argument("--b-layers", type=int, default=8, help="layers of part b's model")
    p.add_argument("--job", help=argparse.SUPPRESS)  # a child: the engine it runs
    p.add_argument("--job-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.device is None:
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.job:
        sys.exit(run_child(args))
    sys.exit(run_parent(args))


# ---------------------------------------------------------------------------- parent

def run_parent(args) -> int:
    """Every selected engine in a child process, within the budget; results.json after each."""
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    args.tokenizer = resolve_tokenizer(args.tokenizer).resolve()
    parts = set(args.parts.split(","))
    results = {"config": {k: str(v) for k, v in vars(args).items() if v is not None},
               "sizes": SIZES[args.device], "jobs": {}, "checks": {}}
    start, failed = time.perf_counter(), 0
    for name, part in JOBS:
        if part not in parts:
            continue
        left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - start)
        if left is not None and left < FIRST_RESULT_S[args.device][name]:
            results["jobs"][name] = {"status": "skipped", "left_s": left,
                                     "first_result_s": FIRST_RESULT_S[args.device][name]}
        else:
            results["jobs"][name] = run_job(args, name, left)
        failed += results["jobs"][name]["status"] not in ("ok", "skipped")
        results["checks"] = checks(results["jobs"])
        write(args.out, results)
        print(f"[{time.perf_counter() - start:6.0f} s] {name}: "
              f"{results['jobs'][name]['status']}", flush=True)
    print(json.dumps(results["checks"], indent=1))
    return int(failed > 0)


def resolve_tokenizer(path: Path | None) -> Path:
    if path is not None:
        return path
    from vllm_triforce import assets
    return assets.ensure_model("smollm2-135m")


def run_job(args, name: str, left: float | None) -> dict:
    """One engine in a child process (its own session, so a timeout stops everything it
    started); its log appended to jobs.log; its results, partial ones too, read back."""
    partial = args.work / f"{name}.json"
    partial.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--job", name,
               "--job-out", str(partial), "--out", str(args.out), "--device", args.device,
               "--tokenizer", str(args.tokenizer), "--work", str(args.work),
               "--b-layers", str(args.b_layers)]
    log = args.out / "jobs.log"
    start = time.perf_counter()
    with log.open("a") as sink:
        sink.write(f"\n===== {name} =====\n")
        sink.flush()
        child = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            status = "ok" if child.wait(timeout=left) == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            status = "stopped at the budget"
    job = {"status": status, "wall_s": time.perf_counter() - start}
    if partial.exists():
        job["result"] = json.loads(partial.read_text())
    if status != "ok":
        print(log_tail(log), flush=True)
    return job


def log_tail(log: Path, lines: int = 25) -> str:
    """The last lines of a log without vLLM's INFO and DEBUG lines."""
    kept = [line for line in log.read_text(errors="replace").splitlines()
            if " INFO " not in line and " DEBUG " not in line]
    return "\n".join(kept[-lines:])


def write(out: Path, results: dict) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


# ---------------------------------------------------------------------------- checks

def checks(jobs: dict) -> dict:
    """The figures issue 59 asks of each part, from what the engines saved (an engine cut
    short or failed too: its rows so far)."""
    saved = {name: job["result"] for name, job in jobs.items() if job.get("result")}
    out = {}
    for name in ("a-2L", "a-3L"):
        if name in saved:
            out[name] = levels_check(saved[name], saved.get("a-plain"))
    if "t-2L" in saved:  # a-plain's tokens are FLASH_ATTN bf16's: no reference for float32
        out["t-2L"] = levels_check(saved["t-2L"], None)
    for name in ("b", "c"):
        if saved.get(name, {}).get("rows"):
            out[name] = summarise_rows(saved[name]["rows"], saved[name].get("memory"))
            profile = saved[name].get("host_ops")
            if profile:  # where a graphed round's host time goes: the totals, the top sites
                out[name]["host_ops"] = {**{k: profile[k] for k in
                                            ("ops_per_round", "host_ms_per_round")},
                                         "top": profile["sites"][:8]}
    return out


def levels_check(result: dict, plain: dict | None) -> dict:
    """Per generation of a TriForce engine of (a): acceptance, drafts verified, the passes
    that took the graphs, its tokens against plain vLLM's and against the same engine's
    with the graphs off, the rounds against today's path, the syncs."""
    from vllm_triforce.tools.bench.gpu_summary import compare_tokens

    out = {"path": result.get("round_graphs", {}).get("path")}
    for key in ("compared", "synced", "ahead", "per_pass"):
        run = result.get(key)
        if run and "error" in run:
            out[key] = {"error": run["error"].strip().splitlines()[-1]}
        if not run or "tokens" not in run:
            continue
        row = {"acceptance": acceptance(run["stats"]), "drafted": run["stats"]["top_proposed"] > 0,
               **{k: run["stats"].get(k) for k in ("round_graph_passes", "round_graph_misses",
                                                   "round_graph_ahead",
                                                   "round_graph_selections",
                                                   "round_graph_layouts",
                                                   "round_graph_launched_ahead")}}
        if plain is not None and "tokens" in plain:
            row["against_plain"] = compare_tokens(plain["tokens"], run["tokens"],
                                                  plain.get("margins"))
        if key != "per_pass" and "tokens" in result.get("per_pass", {}):
            row["against_per_pass"] = compare_tokens(result["per_pass"]["tokens"],
                                                     run["tokens"], None)
        for extra in ("rounds", "syncs"):
            if extra in run:
                row[extra] = {k: v for k, v in run[extra].items()
                              if k not in ("by_op", "cuda_sites")}
        out[key] = row
    graphs, eager = out.get("compared", {}), out.get("per_pass", {})
    if graphs.get("acceptance") is not None and eager.get("acceptance") is not None:
        out["acceptance_points_apart"] = 100 * (graphs["acceptance"] - eager["acceptance"])
    return out


def acceptance(stats: dict) -> float | None:
    return stats["top_accepted"] / stats["top_proposed"] if stats["top_proposed"] else None


# ----------------------------------------------------------------------------- child

class Report(dict):
    """A child's results, written to its file whenever `save` is called."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def save(self) -> None:
        self.path.write_text(json.dumps(self))


def run_child(args) -> int:
    """One engine's job (`--job`), its report saved as it goes and on any error."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    report = Report(args.job_out)
    report["device_name"] = device_name(args.device)
    run = {"a-2L": lambda: job_levels(args, report, 2), "a-3L": lambda: job_levels(args, report, 3),
           "a-plain": lambda: job_plain(args, report), "b": lambda: job_width(args, report),
           "c": lambda: job_smollm2(args, report),
           "t-2L": lambda: job_levels(args, report, 2, part="t")}[args.job]
    try:
        run()
    except BaseException:  # the finding: kept with whatever the job measured before
        report["error"] = traceback.format_exc()[-4000:]
        report.save()
        raise
    report.save()
    return 0


def device_name(device: str) -> str:
    """The card's name (every number in the results is this card's), or the CPU's."""
    import platform

    import torch
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"


def engine_llm(args, part: str, **over) -> dict:
    """LLM keywords of a part's engine: FLASH_ATTN bf16 (t: TRITON_ATTN float32) compiled on
    a GPU without vLLM's JIT kernel warm-up (dummy weights for b and c), CPU_ATTN float32
    eager on a CPU."""
    if args.device == "cpu":
        base = {"dtype": "float32", "enforce_eager": True, "block_size": 32,
                "attention_config": {"backend": "CPU_ATTN"}}
    else:  # no JIT kernel warm-up: on a fresh machine it took most of a 145 s cap
        # (2026-11-30); a kernel compiles at its first use instead, in a warm-up run
        base = {"dtype": "bfloat16", "gpu_memory_utilization": 0.85,
                "attention_config": {"backend": "FLASH_ATTN"},
                "kernel_config": {"enable_jit_warmup": False}}
    if part == "t" and args.device == "cuda":  # in float32 (SIZES)
        base["attention_config"] = {"backend": "TRITON_ATTN"}
    if part not in ("a", "t"):
        base["load_format"] = "dummy"
    return {**base, "seed": 0, **SIZES[args.device][part]["llm"], **over}


def build(args, report: Report, model: Path, spec: dict | None, part: str, **over):
    """The engine, its start time and facts in the report."""
    from vllm_triforce.tools.bench.gpu_engine import build_llm, engine_facts

    start = time.perf_counter()
    llm = build_llm({"model": str(model), "spec": spec, "llm": engine_llm(args, part, **over)})
    report["start_s"] = time.perf_counter() - start
    report["facts"] = engine_facts(llm)
    report.save()
    return llm


def tokenizer_vocab(args) -> int:
    from vllm_triforce.tools.bench import gpu_models
    return gpu_models.tokenizer_vocab_size(args.tokenizer)


# ------------------------------------------------------------------ (a) correctness

def tiny_models(args) -> tuple[Path, Path]:
    from vllm_triforce.tools.bench import gpu_models
    return gpu_models.build_tiny_pair(args.work / "tiny", args.tokenizer)


def tiny_prompts(args) -> list[list[int]]:
    from vllm_triforce.tools.bench.gpu_engine import random_prompts

    a = SIZES[args.device]["a"]
    longest = a["shortest"] + a["step"] * (a["prompts"] - 1)
    return [p[:a["shortest"] + a["step"] * i] for i, p in
            enumerate(random_prompts(a["prompts"], longest, tokenizer_vocab(args), seed=3))]


def greedy(args, logprobs: int | None = None):
    from vllm import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=SIZES[args.device]["a"]["max_tokens"],
                          ignore_eos=True, logprobs=logprobs)


def job_plain(args, report: Report) -> None:
    """Plain vLLM with TriForce's forced settings (V1 runner, PIECEWISE graphs, synchronous
    scheduling): the tokens, and plain's own top-2 log-prob margins at every position."""
    from vllm_triforce.tools.bench.gpu_engine import token_prompts, top2_margins

    os.environ.update(FORCED_SETTINGS["env"])
    forced = FORCED_SETTINGS["llm"]
    compilation = {**SIZES[args.device]["a"]["llm"].get("compilation_config", {}),
                   **forced["compilation_config"]}
    over = ({"async_scheduling": False} if args.device == "cpu" else
            {**forced, "compilation_config": compilation})
    llm = build(args, report, tiny_models(args)[0], None, "a", **over)
    outputs = llm.generate(token_prompts(tiny_prompts(args)), greedy(args, logprobs=2),
                           use_tqdm=False)
    report["tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
    report["margins"] = [top2_margins(o.outputs[0]) for o in outputs]


def job_levels(args, report: Report, levels: int, part: str = "a") -> None:
    """TriForce with round graphs, two or three levels, fixed depth, on part `part`'s
    engine (a: FLASH_ATTN bf16, t: TRITON_ATTN float32): four generations of the same
    prompts, each saved as it completes: every round against today's path (`compared`),
    syncs counted (`synced`), syncs counted with each round's next pass launched before
    the round's copy is waited for (`ahead`, VLLM_TRIFORCE_LAUNCH_AHEAD=1), round graphs
    off (`per_pass`)."""
    from vllm_triforce.tools.bench.gpu_engine import drafter_or_none

    target, draft = tiny_models(args)
    spec = {**TINY_SPEC, "round_graphs": True, "compiled_selection": True,
            "selection_graphs": True,
            **({"model": str(draft), **THREE_LEVELS} if levels == 3 else {})}
    llm = build(args, report, target, spec, part)
    drafter = drafter_or_none(llm)
    drafter.set_fixed_depth(SIZES[args.device][part]["depth"])
    graphs = drafter.retrieval.round_graphs
    captures = watch_captures(graphs) if graphs is not None else []
    prompts, params = tiny_prompts(args), greedy(args)
    for key, generation in (("compared", compared_generation), ("synced", synced_generation),
                            ("ahead", ahead_generation), ("per_pass", per_pass_generation)):
        try:
            report[key] = generation(llm, drafter, prompts, params)
        except Exception:  # kept; the next generation may still run (a CUDA error: not)
            report[key] = {"error": traceback.format_exc()[-4000:]}
        report["round_graphs"] = {**graphs_facts(graphs), "captures": captures}
        report["compiled_selection"] = compiled_facts(drafter)
        report.save()


def generate(llm, drafter, prompts, params) -> dict:
    """Greedy tokens of `prompts`, the wall time, and TriForce's counters over the call."""
    from vllm_triforce.tools.bench.gpu_engine import token_prompts

    before, start = drafter.stats.snapshot(), time.perf_counter()
    outputs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    wall, after = time.perf_counter() - start, drafter.stats.snapshot()
    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "wall_s": wall,
            "stats": {k: after[k] - before[k] for k in COUNTERS}}


def compared_generation(llm, drafter, prompts, params) -> dict:
    """A generation in which every round's pass also runs today's way, just before its
    replay, over the same inputs and tables (`against_eager`). Both write the same KV
    slots with the same tokens; the replay writes last, so the engine goes on from the
    graph's state."""
    graphs = drafter.retrieval.round_graphs
    if graphs is None:
        return {"skipped": "no round graphs (path per pass): see the engine's log"}
    rounds: list[dict] = []
    graphs.replay = against_eager(drafter.retrieval, graphs, graphs.replay, rounds)
    try:
        out = generate(llm, drafter, prompts, params)
    finally:
        del graphs.replay  # the instance's wrapper: the class's `replay` again
    out["rounds"] = summarise_rounds(rounds)
    out["per_round"] = rounds[:PER_ROUND_KEPT]
    return out


def against_eager(level, graphs, replay, rounds: list):
    """`graphs.replay`, with each loaded pass first run by `forward.run_pass` over copies
    of what the buffers hold (`loaded_inputs`; its queries recorded into buffers of its
    own, so neither vLLM's pass's nor the round's are touched) and the two compared into
    `rounds`."""
    from vllm_triforce.engine.device.capture import CaptureBuffers

    scratch = CaptureBuffers(len(level.layer_names), graphs.bounds.max_tokens, keep_keys=False)

    def compared(loaded):
        inputs, tables = loaded_inputs(graphs, loaded)
        eager, eager_queries = eager_pass(level, scratch, inputs, tables)
        logits = replay(loaded)
        rounds.append(difference(logits, eager, level.capture.queries, eager_queries, inputs))
        return logits
    return compared


def loaded_inputs(graphs, loaded):
    """(PassInputs, tables [L, R, max_width]) of the pass `loaded` left in the round
    buffers, as copies: what today's path runs over (entries past a row's length are
    never read)."""
    from vllm_triforce.engine.device.forward import PassInputs

    b, tokens, reqs = graphs.buffers, loaded.num_tokens, loaded.num_reqs
    inputs = PassInputs.make(b.query_start_loc[:reqs + 1].tolist(), b.seq_lens[:reqs].tolist(),
                             list(range(tokens)), b.input_ids[:tokens].clone(),
                             b.positions[:tokens].clone(), b.slot_mapping[:tokens].clone())
    return inputs, b.tables[:, :reqs].clone()


def eager_pass(level, scratch, inputs, tables):
    """(logits, per-layer queries) of today's path over `inputs` and tables [L, R, W]."""
    from vllm_triforce.engine.device.forward import run_pass

    per_layer = dict(zip(level.layer_names, tables.unbind(0)))
    with level.capture.recording(into=scratch):
        logits = run_pass(level.model, level.vllm_config, level.attn_groups, inputs,
                          per_layer, None, level.pass_limits)
    return logits, list(level.capture.queries)


def difference(graph, eager, graph_queries, eager_queries, inputs) -> dict:
    """How far a replay's logits [T, V] and queries are from today's path's."""
    if graph.shape[0] != eager.shape[0]:  # run_pass returns the sampled rows only
        graph = graph[inputs.sample_rows_dev]
    g, e = graph.float(), eager.float()
    dq = max((a.reshape(a.shape[0], -1).float() - b.reshape(b.shape[0], -1).float()
              ).abs().max().item() for a, b in zip(graph_queries, eager_queries))
    return {"tokens": inputs.num_tokens, "max_abs_logits": (g - e).abs().max().item(),
            "logits_scale": e.abs().max().item(),
            "argmax_equal": (g.argmax(-1) == e.argmax(-1)).float().mean().item(),
            "max_abs_query": dq}


def summarise_rounds(rounds: list[dict]) -> dict:
    if not rounds:
        return {"compared": 0}
    return {"compared": len(rounds),
            "max_abs_logits": max(r["max_abs_logits"] for r in rounds),
            "median_abs_logits": statistics.median(r["max_abs_logits"] for r in rounds),
            "logits_scale": max(r["logits_scale"] for r in rounds),
            "min_argmax_equal": min(r["argmax_equal"] for r in rounds),
            "mean_argmax_equal": statistics.fmean(r["argmax_equal"] for r in rounds),
            "max_abs_query": max(r["max_abs_query"] for r in rounds),
            "tokens": sorted({r["tokens"] for r in rounds})}


def ahead_generation(llm, drafter, prompts, params) -> dict:
    """`synced_generation` with each round's next pass replayed before the round's copy to
    the host is waited for (VLLM_TRIFORCE_LAUNCH_AHEAD=1)."""
    os.environ[LAUNCH_AHEAD] = "1"
    try:
        return synced_generation(llm, drafter, prompts, params)
    finally:
        os.environ.pop(LAUNCH_AHEAD, None)


def synced_generation(llm, drafter, prompts, params) -> dict:
    """A generation with the syncs inside `propose` counted per middle round
    (tools/bench/syncs.py; on a CPU every tensor counts, an approximation), and on a GPU
    torch's sync debug mode attributing every synchronising CUDA call to its site
    (gpu_job.SyncAttribution: TriForce's, or vLLM's)."""
    import torch

    from vllm_triforce.tools.bench.gpu_job import SyncAttribution, sync_owner
    from vllm_triforce.tools.bench.syncs import ProposeSyncs, summarise

    attribution = SyncAttribution() if torch.cuda.is_available() else None
    with ProposeSyncs(drafter) as recorder:
        if attribution is not None:
            with attribution:
                out = generate(llm, drafter, prompts, params)
        else:
            out = generate(llm, drafter, prompts, params)
    s = summarise(recorder.take())
    out["syncs"] = {k: s[k] for k in ("max_round", "mean_round", "num_rounds", "max_step",
                                      "mean_step", "once", "host")}
    out["syncs"]["by_op"] = s["by_op"]
    if attribution is not None:
        ours = sum(n for site, n in attribution.sites.items() if sync_owner(site) == "triforce")
        out["syncs"]["cuda_sites"] = dict(attribution.sites.most_common())
        out["syncs"]["cuda_triforce_per_round"] = ours / max(out["stats"]["middle_rounds"], 1)
    return out


def per_pass_generation(llm, drafter, prompts, params) -> dict:
    """The same generation with the round graphs off: today's per-pass path (the
    selection graphs, which load the round graphs' buffers, are off with them)."""
    level = drafter.retrieval
    graphs, level.round_graphs = level.round_graphs, None
    try:
        return generate(llm, drafter, prompts, params)
    finally:
        level.round_graphs = graphs


def compiled_facts(drafter) -> dict:
    """Whether the compiled selection is on (a failed compilation, or a call that would have
    compiled again, leaves the eager reads, with a warning in the log), whether a step's
    whole selection compiled, how long its
    scores' compilation took, whether a middle pass's layout is compiled too, and the
    lazy summaries' read of the KV cache (None: the summaries are not set lazily)."""
    compiled, graphs = drafter.policy.compiled, drafter.retrieval.round_graphs
    reads, fused = drafter.retrieval.keeper.block_reads, drafter.retrieval.selection_graphs
    return {"on": compiled is not None,
            "selection_graphs": None if fused is None else {
                "path": "cuda graphs" if fused.use_cuda_graphs else "eager over buffers",
                "failed": fused.failed, "prepared": sorted(fused.runs),
                "buffer_bytes": fused.nbytes, "pool_bytes": fused.pool_bytes()},
            "compile_seconds": None if compiled is None else compiled.compile_seconds,
            # why a step's whole selection did not compile (None: it did): then its
            # scores are the compiled kernel's, ranked eagerly
            "step_selection_failed": None if compiled is None else compiled.table_failed,
            "layout_on": graphs is not None and graphs.buffers.layout.compiled is not None,
            "block_reads_on": reads.compiled is not None if reads.wanted else None,
            "block_reads_compile_seconds": reads.compile_seconds}


def graphs_facts(graphs) -> dict:
    """The path the middle passes take, the buckets' bounds, what is prepared so far."""
    if graphs is None:
        return {"path": "per pass"}
    b = graphs.bounds
    return {"path": "cuda graphs" if graphs.use_cuda_graphs else "eager over buffers",
            "buckets": list(b.buckets), "max_tokens": b.max_tokens,
            "max_requests": b.max_requests, "max_width": b.max_width,
            "buffer_bytes": graphs.nbytes, "prepared": sorted(graphs.replays)}


def watch_captures(graphs) -> list[dict]:
    """Each `_prepare` (a bucket built; on a GPU every bucket captured at once): its
    seconds and, on a GPU, `bytes` allocated after it beyond before (the graphs' live
    outputs), `reserved_bytes` (the change in what torch reserves: each capture empties
    the allocator's cache first, so it can be negative) and `pool_bytes` (the graphs'
    private pool, `RoundGraphs.pool_bytes`: what the reservation must hold)."""
    import torch

    captures, prepare, cuda = [], graphs._prepare, torch.cuda.is_available()

    def held() -> tuple[int, int]:
        return (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) if cuda else (0, 0)

    def measured(bucket):
        before, start = held(), time.perf_counter()
        replay = prepare(bucket)
        after = held()
        captures.append({"bucket": bucket, "s": time.perf_counter() - start,
                         "bytes": after[0] - before[0] if cuda else None,
                         "reserved_bytes": after[1] - before[1] if cuda else None,
                         "pool_bytes": graphs.pool_bytes() if cuda else None})
        return replay
    graphs._prepare = measured
    return captures


# --------------------------------------------------------------------- (b), (c) costs

def job_width(args, report: Report) -> None:
    """(b): Llama-3.1-8B's width, `--b-layers` layers, depth 6: graphs on and off, twice
    each, with and without the forwards synchronised."""
    from vllm_triforce.tools.bench import gpu_models

    s = SIZES[args.device]["b"]
    over = {"num_hidden_layers": args.b_layers, **s["over"]}
    if args.device == "cpu":
        over["vocab_size"] = tokenizer_vocab(args)
    model = gpu_models.write_llama_8b_shape(
        args.work / f"llama-8b-width-{over['num_hidden_layers']}l", args.tokenizer, **over)
    spec = {**COST_SPEC, "retrieval_budget": s["budget"], "round_graphs": True,
            "compiled_selection": True, "selection_graphs": True}
    plan = ([(s["depth"], mode, False) for mode in MODES + MODES]
            + [(s["depth"], mode, True) for mode in (FUSED, PER_PASS)])
    cost_job(args, report, model, spec, "b", plan)


def job_smollm2(args, report: Report) -> None:
    """(c): SmolLM2-135M's shape: ms per round and per step at depths 6 and 0, graphs on
    and off, twice each."""
    from vllm_triforce.tools.bench import gpu_models

    s = SIZES[args.device]["c"]
    model = gpu_models.write_llama_8b_shape(args.work / "smollm2-135m-shape", args.tokenizer,
                                            **{**SMOLLM2_SHAPE, **s["over"]})
    spec = {**COST_SPEC, "retrieval_budget": s["budget"], "round_graphs": True,
            "compiled_selection": True, "selection_graphs": True}
    # depth 0 selects nothing: the graphed modes are one mode there
    plan = [(depth, mode, False) for depth in s["depths"]
            for mode in (MODES + MODES if depth else (FUSED, PER_PASS) * 2)]
    cost_job(args, report, model, spec, "c", plan)


def cost_job(args, report: Report, model: Path, spec: dict, part: str, plan) -> None:
    """One engine: prefill, then a row per (depth, graphs on, forwards synchronised) of
    `plan`, saved as each completes; the summary and memory last."""
    import torch

    from vllm_triforce.tools.bench.gpu_costs import MemoryProbe, timed_generate
    from vllm_triforce.tools.bench.gpu_engine import drafter_or_none, random_prompts

    s, cuda = SIZES[args.device][part], torch.cuda.is_available()
    memory = MemoryProbe() if cuda else None
    if memory is not None:
        memory.install_init_probe()
    llm = build(args, report, model, spec, part)
    drafter = drafter_or_none(llm)
    graphs, compiled = drafter.retrieval.round_graphs, drafter.policy.compiled
    fused = drafter.retrieval.selection_graphs
    layout = None if graphs is None else graphs.buffers.layout.compiled
    report["captures"] = watch_captures(graphs) if graphs is not None else []
    peaks, timer = PeakProbe(drafter, cuda), ReplayTimer(graphs, cuda, fused)
    prompts = random_prompts(s["batch"], s["context"], tokenizer_vocab(args), seed=s["context"])
    report["prefill_s"] = timed_generate(llm, prompts, 1)
    # after the prefill: without a warm-up (enforce_eager) the lazy reads compile at the
    # first commit
    report["compiled_selection"] = compiled_facts(drafter)
    reads = drafter.retrieval.keeper.block_reads
    reads_fn = reads.compiled
    report["rows"] = []
    for depth, mode, synced in plan:
        compiled_on = mode in (AHEAD, FUSED, COMPILED)
        drafter.policy.compiled = compiled if compiled_on else None
        reads.compiled = reads_fn if compiled_on else None
        drafter.retrieval.selection_graphs = fused if mode in (AHEAD, FUSED) else None
        os.environ.pop(LAUNCH_AHEAD, None)
        if mode == AHEAD:
            os.environ[LAUNCH_AHEAD] = "1"
        if graphs is not None:
            graphs.buffers.layout.compiled = layout if compiled_on else None
        report["rows"].append(measure(llm, drafter, graphs, prompts, s["decode"], depth,
                                      mode != PER_PASS, synced, peaks, timer))
        report["rows"][-1]["mode"] = mode
        if compiled_on:  # False: none compiled at start-up, or one failed in the row
            report["rows"][-1]["compiled_held"] = (
                compiled is not None and drafter.policy.compiled is compiled
                and layout is not None and graphs.buffers.layout.compiled is layout
                and reads.compiled is reads_fn)
        os.environ.pop(LAUNCH_AHEAD, None)
        if mode in (AHEAD, FUSED):  # None: no selection graphs; else why they were given up, if
            report["rows"][-1]["selection_graphs_failed"] = (
                "none built" if fused is None else fused.failed)
        report["round_graphs"] = graphs_facts(graphs)
        report.save()
    drafter.retrieval.round_graphs, drafter.policy.compiled = graphs, compiled
    reads.compiled, drafter.retrieval.selection_graphs = reads_fn, fused
    timer.uninstall_selection()
    if graphs is not None:
        graphs.buffers.layout.compiled = layout
        report["host_ops"] = host_profile(llm, drafter, prompts, s["decode"][0],
                                          plan[0][0])
        report.save()
    report["memory"] = memory_report(drafter, memory, peaks, report["captures"])


def host_profile(llm, drafter, prompts, decode: int, depth: int) -> dict:
    """Where a graphed middle round's host time goes: a decode of `decode` tokens at
    `depth` with round graphs on, every aten operation `propose` dispatches outside the
    model by call site with its host time (tools/bench/host_ops.py: on a GPU its dispatch
    and launch, not its kernel), per middle round, a graph's launch included."""
    from vllm_triforce.tools.bench.gpu_costs import timed_generate
    from vllm_triforce.tools.bench.host_ops import HostOps

    drafter.set_fixed_depth(depth)
    before = drafter.stats.snapshot()["middle_rounds"]
    with HostOps(drafter) as ops:
        timed_generate(llm, prompts, decode)
    return ops.summary(drafter.stats.snapshot()["middle_rounds"] - before)


def measure(llm, drafter, graphs, prompts, decode, depth: int, on: bool, synced: bool,
            peaks, timer) -> dict:
    """One row: round graphs on or off, forwards synchronised or not, a warm-up decode,
    then the step's time from a short and a long decode (step_timing.decode_step) and the
    long one's split (gpu_costs.depth_row: ms per middle round, of which forwards)."""
    from vllm_triforce.tools.bench.gpu_costs import depth_row, timed_generate
    from vllm_triforce.tools.bench.step_timing import decode_step

    drafter.retrieval.round_graphs = graphs if on else None
    os.environ.pop(TIME_FORWARDS, None)
    if synced:
        os.environ[TIME_FORWARDS] = "1"
    drafter.set_fixed_depth(depth)
    short, long = decode
    peaks.label = None  # the warm-up's peak holds the first capture: not a propose's own
    timed_generate(llm, prompts, short)  # warm-up in this mode (on: captures the first time)
    peaks.label = "graphs" if on else "per pass"
    if on:
        timer.install()
    timer.take()
    timer.take_selections()
    counted = []

    def timed(m: int) -> tuple[float, int]:
        before = drafter.stats.snapshot()
        wall = timed_generate(llm, prompts, m)
        after = drafter.stats.snapshot()
        counted.append((m, wall, before, after))
        return wall, sum(after[k] - before[k] for k in ("plain_steps", "drafting_steps"))

    try:
        timing = decode_step(timed, short, long, repeats=1)
    finally:
        os.environ.pop(TIME_FORWARDS, None)
    m, wall, before, after = [c for c in counted if c[0] == timing["long"]][-1]
    row = depth_row(before, after, wall, m - 1, len(prompts))
    replay_ms, replays = timer.take()
    selection_ms, selections = timer.take_selections()
    row.update(depth=depth, graphs=on, synced_forwards=synced,
               step_ms=None if timing["step_s"] is None else 1000 * timing["step_s"],
               timing=timing, replays=replays,
               replay_ms_per_round=replay_ms / replays if replays else None,
               # the selection graphs' device time a middle round (a round loads the next
               # one's pass by one launch; a step's last round launches none)
               selection_launches=selections,
               selection_ms_per_round=(selection_ms / (after["middle_rounds"]
                                                       - before["middle_rounds"])
                                       if selections else None),
               **{k: after[k] - before[k] for k in ("round_graph_passes", "round_graph_misses",
                                                    "round_graph_selections",
                                                    "round_graph_layouts", "middle_rounds",
                                                    "round_graph_launched_ahead")})
    return row


class PeakProbe:
    """The CUDA allocator's peak above its level at entry of each `propose`, the largest
    per `label` (the mode being measured; None: not recorded); nothing on a CPU."""

    def __init__(self, drafter, cuda: bool):
        self.label, self.peaks = None, {}
        if cuda:
            self._install(drafter)

    def _install(self, drafter) -> None:
        import torch

        propose = drafter.propose

        def measured(*args, **kwargs):
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            try:
                return propose(*args, **kwargs)
            finally:
                if self.label is not None:
                    peak = torch.cuda.max_memory_allocated() - base
                    self.peaks[self.label] = max(self.peaks.get(self.label, 0), peak)

        drafter.propose = measured


class ReplayTimer:
    """The time of each bucket replay. A captured graph's: from CUDA events recorded just
    before and after its launch (`EventTimedGraph`), its device time without a sync per
    round (the two events cost the host a few microseconds); the host's work before the
    launch (loading the buffers, refreshing the scheduler metadata) is not in it. An
    eager replay's (a CPU's): its wall time. The same for each launch of the selection
    graphs (`selection`: engine/device/selection_graph.py, None: none), kept apart: with
    them a round's device work is its pass and the next pass's selection and load."""

    def __init__(self, graphs, cuda: bool, selection=None):
        self.graphs, self.cuda, self.marks = graphs, cuda, []
        self.selection, self.selection_marks = selection, []

    def install(self) -> None:
        """Time every replay prepared so far that is not timed yet, and every launch of
        the selection graphs."""
        if self.selection is not None and not getattr(self.selection, "timed", False):
            self.selection.timed = True
            self.selection.launch = self._timed_launch(self.selection.launch)
        for replay in (self.graphs.replays.values() if self.graphs is not None else ()):
            if getattr(replay, "timed", False):
                continue
            replay.timed = True
            if self.cuda and hasattr(replay, "graph"):  # CudaGraphReplay
                replay.graph = EventTimedGraph(replay.graph, self.marks)
            else:
                replay.run = self._wall_timed(replay.run)

    def _wall_timed(self, run):
        def timed():
            start = time.perf_counter()
            out = run()
            self.marks.append(time.perf_counter() - start)
            return out
        return timed

    def uninstall_selection(self) -> None:
        """The selection graphs' own `launch` again (what a profiler of the class finds)."""
        if getattr(self.selection, "timed", False):
            del self.selection.launch
            self.selection.timed = False

    def _timed_launch(self, launch):
        """`launch(run)` with its device time (CUDA events around it) or, on a CPU, its
        wall time appended to `selection_marks`."""
        import torch

        def timed(run) -> None:
            if not self.cuda:
                start = time.perf_counter()
                launch(run)
                self.selection_marks.append(time.perf_counter() - start)
                return
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            launch(run)
            end.record()
            self.selection_marks.append((start, end))
        return timed

    def take(self) -> tuple[float, int]:
        """(ms of the replays since the last take, their number)."""
        return self._take(self.marks)

    def take_selections(self) -> tuple[float, int]:
        """(ms of the selection graphs' launches since the last take, their number)."""
        return self._take(self.selection_marks)

    def _take(self, kept: list) -> tuple[float, int]:
        import torch

        marks, kept[:] = list(kept), []
        if self.cuda and marks and not isinstance(marks[0], float):
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in marks), len(marks)
        return 1000 * sum(marks), len(marks)


class EventTimedGraph:
    """A captured torch.cuda.CUDAGraph whose `replay` appends (start, end) CUDA events
    around its launch to `marks` (what CudaGraphReplay.run calls)."""

    def __init__(self, graph, marks: list):
        self.graph, self.marks = graph, marks

    def replay(self) -> None:
        import torch

        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        self.graph.replay()
        end.record()
        self.marks.append((start, end))


def memory_report(drafter, memory, peaks: PeakProbe, captures: list) -> dict | None:
    """TriForce's CUDA memory against its reservation, per mode: what
    `initialize_attn_backend` keeps, what the graphs' captures hold (their private
    pools' segments: the round graphs' and the selection graphs'), each mode's propose
    peak (None on a CPU)."""
    if memory is None:
        return None
    import torch

    captured = max((c.get("pool_bytes") or 0 for c in captures), default=0)  # one pool
    fused = drafter.retrieval.selection_graphs
    selection_pool = 0 if fused is None else fused.pool_bytes()  # the selection graphs' own
    captured += selection_pool
    return {"reserved_bytes": drafter.reserved_bytes, "persistent_bytes": memory.persistent,
            "capture_bytes": captured, "selection_pool_bytes": selection_pool, "propose_peak_bytes": dict(peaks.peaks),
            "within_reservation": {label: memory.persistent + captured + peak
                                   <= drafter.reserved_bytes
                                   for label, peak in peaks.peaks.items()},
            "max_reserved_by_torch": torch.cuda.max_memory_reserved()}


def summarise_rows(rows: list[dict], memory: dict | None) -> dict:
    """Per depth and mode (`MODES`; rows saved before the modes: graphs or per pass),
    medians over the rows: ms per step and per middle round (unsynchronised rows), the
    forwards' ms per round (synchronised rows: device time of the passes) and the replays'
    device ms per round; with graphs, a round's cost over its pass's device time."""
    out = {}
    for row in rows:
        row.setdefault("mode", GRAPHS if row["graphs"] else PER_PASS)
    for depth in sorted({r["depth"] for r in rows}, reverse=True):
        for mode in MODES:
            mine = [r for r in rows if r["depth"] == depth and r["mode"] == mode]
            if not mine:
                continue
            on = mode != PER_PASS
            free = [r for r in mine if not r["synced_forwards"]]
            synced = [r for r in mine if r["synced_forwards"]]
            cell = {"step_ms": median(r["step_ms"] for r in free),
                    "middle_round_ms": median(r["middle_round_ms"] for r in free),
                    "middle_round_ms_each": [r["middle_round_ms"] for r in free],
                    "acceptance": median(r["acceptance"] for r in free),
                    "forward_ms_per_round_synced": median(r["forward_ms_per_round"]
                                                          for r in synced),
                    "replay_ms_per_round": median(r["replay_ms_per_round"] for r in mine),
                    "selection_ms_per_round": median(r.get("selection_ms_per_round")
                                                     for r in mine)}
            if mode in (AHEAD, FUSED, COMPILED):  # every row's scores came from the kernels
                cell["compiled_held"] = all(r.get("compiled_held", True) for r in mine)
            if mode in (AHEAD, FUSED):  # rounds loaded by a selection graph, of the rounds
                for counter in ("round_graph_selections", "round_graph_layouts",
                                "round_graph_launched_ahead"):
                    cell[counter] = sum(r.get(counter, 0) for r in mine)
                cell["middle_rounds"] = sum(r.get("middle_rounds", 0) for r in mine)
            if on and cell["middle_round_ms"] and cell["replay_ms_per_round"]:
                cell["round_over_replay"] = cell["middle_round_ms"] / cell["replay_ms_per_round"]
                # the round's device work with the selection graph's (where it ran)
                device = cell["replay_ms_per_round"] + (cell["selection_ms_per_round"] or 0)
                cell["device_ms_per_round"] = device
                cell["round_over_device"] = cell["middle_round_ms"] / device
            out[f"depth {depth}, {mode}"] = cell
    if memory is not None:
        out["within_reservation"] = memory["within_reservation"]
    return out


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


if __name__ == "__main__":
    main()
