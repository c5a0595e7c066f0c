"""Where a TriForce step's time goes on a GPU at Llama-3.1-8B's shape (random weights,
FLASH_ATTN, bf16, compiled with TriForce's settings): the bench gpu cost table measured a
middle round at 22-31 ms on an H200 (2026-11-28), where a pass over a 4K-token cache
should cost about a short-context plain step. This script answers why, in one engine:

1. wall and counters of a decode at fixed depth 6 (ms per step, per middle round, and
   the model forwards' share as the host sees it);
2. the same with VLLM_TRIFORCE_TIME_FORWARDS=1 (a device sync per pass: the forwards'
   device time);
3. torch.profiler over a short decode: ops by self CPU time and by device time;
4. cProfile over a short decode: Python functions by own and cumulative time;
5. cProfile at depth 0 (TriForce's plain path against plain vLLM's step).

Each part is written to `--out` as it completes. Run on a GPU machine through
`scripts/gpu_run.sh -- python3 <abs path>/benchmarks/explore/gpu_round_profile.py --out D
--tokenizer <bundle>/tokenizer`.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=8192 - 512)
    p.add_argument("--depth", type=int, default=6)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    from vllm_triforce.tools.bench import gpu_models
    from vllm_triforce.tools.bench.gpu_costs import timed_generate
    from vllm_triforce.tools.bench.gpu_engine import (build_llm, drafter_or_none,
                                                       engine_facts, random_prompts)
    from vllm_triforce.tools.bench.gpu_plan import COST_SPEC

    shape = gpu_models.write_llama_8b_shape(Path("/tmp/vt-profile/llama-3.1-8b-shape"),
                                            args.tokenizer)
    vocab = gpu_models.tokenizer_vocab_size(args.tokenizer)
    job = {"model": str(shape), "spec": COST_SPEC,
           "llm": {"load_format": "dummy", "dtype": "bfloat16", "max_model_len": 32768,
                   "seed": 0, "gpu_memory_utilization": 0.85, "max_num_seqs": 64,
                   "attention_config": {"backend": "FLASH_ATTN"}}}
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    start = time.perf_counter()
    llm = build_llm(job)
    report["start_s"] = time.perf_counter() - start
    report["facts"] = engine_facts(llm)
    drafter = drafter_or_none(llm)
    prompts = random_prompts(args.batch, args.context, vocab, seed=1)

    def save() -> None:
        (args.out / "profile.json").write_text(json.dumps(report, indent=1))

    report["prefill_s"] = timed_generate(llm, prompts, 1)
    drafter.set_fixed_depth(args.depth)
    timed_generate(llm, prompts, 8)  # warm-up at this depth

    def decode(tokens: int) -> dict:
        before = drafter.stats.snapshot()
        wall = timed_generate(llm, prompts, tokens)
        after = drafter.stats.snapshot()
        d = {k: after[k] - before[k] for k in ("plain_steps", "drafting_steps",
                                               "middle_rounds", "middle_seconds",
                                               "forward_seconds")}
        steps = max(d["plain_steps"] + d["drafting_steps"], 1)
        rounds = max(d["middle_rounds"], 1)
        return {"wall_s": wall, "steps": steps, "ms_per_step": 1000 * wall / steps,
                "middle_round_ms": 1000 * d["middle_seconds"] / rounds,
                "forward_ms_per_round": 1000 * d["forward_seconds"] / rounds,
                "rounds": d["middle_rounds"]}

    report["decode"] = decode(40)
    save()
    os.environ["VLLM_TRIFORCE_TIME_FORWARDS"] = "1"
    report["decode_synced_forwards"] = decode(40)
    os.environ.pop("VLLM_TRIFORCE_TIME_FORWARDS")
    save()

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed_generate(llm, prompts, 12)
    averages = prof.key_averages()
    (args.out / "torch_profile.txt").write_text(
        "by self CPU time\n"
        + averages.table(sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=90)
        + "\n\nby device time\n"
        + averages.table(sort_by="self_cuda_time_total", row_limit=40,
                         max_name_column_width=90))
    try:
        prof.export_chrome_trace(str(args.out / "trace.json"))
        os.system(f"gzip -f {args.out / 'trace.json'}")
    except Exception as err:  # the tables matter more than the trace
        report["trace_error"] = repr(err)
    save()

    def profiled(name: str, tokens: int) -> None:
        profiler = cProfile.Profile()
        profiler.enable()
        timed_generate(llm, prompts, tokens)
        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(70)
        stats.sort_stats("cumtime").print_stats(90)
        (args.out / f"cprofile_{name}.txt").write_text(text.getvalue())

    profiled(f"depth{args.depth}", 12)
    drafter.set_fixed_depth(0)
    timed_generate(llm, prompts, 8)
    report["decode_depth0"] = decode(40)
    save()
    profiled("depth0", 24)
    torch.cuda.synchronize()
    report["total_s"] = time.perf_counter() - start
    save()


if __name__ == "__main__":
    main()
