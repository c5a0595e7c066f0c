"""Aten operations per middle round outside the model forwards, by vllm_triforce call site.

Issue 25's host overhead, counted instead of timed: on a GPU each operation is at least one
launch (~5-10 us of host time), on this CPU one dispatch; unlike milliseconds on a shared
2-vCPU host, the count does not move between runs. Same model and settings as
host_overhead.py (30 layers, hidden 64, 1,024-token vocabulary, batch 8, fixed depth 6,
greedy, re-selection between every middle round).

    .venv/bin/python benchmarks/explore/host_ops.py [--top 40]
"""

import argparse
import collections
import os
import sys
import tempfile
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()

    import tiny_models
    from torch.utils._python_dispatch import TorchDispatchMode
    from vllm import LLM, SamplingParams

    from vllm_triforce.engine import forward
    from vllm_triforce.offline import drafter_of

    tmp = Path(tempfile.mkdtemp(prefix="host_ops_"))
    target = tiny_models.build_tiny_llama(tmp / "target", num_layers=30, hidden=64, heads=2,
                                          kv_heads=2, vocab_size=1024)
    spec = {"method": "triforce", "num_speculative_tokens": 6, "retrieval_budget": 256,
            "retrieval_sink_tokens": 32, "retrieval_recent_tokens": 64, "adaptive": False,
            "refresh_interval": 1}
    llm = LLM(str(target), dtype="float32", enforce_eager=True, block_size=32,
              max_model_len=2048, speculative_config=spec, seed=0)
    prompts = [tiny_models.make_text(400, seed=i) for i in range(8)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    drafter = drafter_of(llm)
    in_model = [0]  # > 0 inside a model forward: its operations are not counted
    sites: collections.Counter = collections.Counter()

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not in_model[0]:
                sites[_call_site()] += 1
            return func(*args, **(kwargs or {}))

    model_forward = forward.run

    def uncounted_forward(*args, **kwargs):
        in_model[0] += 1
        try:
            return model_forward(*args, **kwargs)
        finally:
            in_model[0] -= 1

    forward.run = uncounted_forward
    propose = drafter.propose

    def counted_propose(*args, **kwargs):
        with Counting():
            return propose(*args, **kwargs)

    drafter.propose = counted_propose
    before = drafter.stats.snapshot()["middle_rounds"]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
                 use_tqdm=False)
    rounds = drafter.stats.snapshot()["middle_rounds"] - before
    total = sum(sites.values())
    print(f"operations outside model forwards: {total} over {rounds} middle rounds = "
          f"{total / rounds:.1f} per round (commit, selection and hand-off included)")
    for site, count in sites.most_common(args.top):
        print(f"{count / rounds:7.1f}  {site}")


def _call_site() -> str:
    """The innermost vllm_triforce frame of the current stack, as file:line function."""
    for frame in reversed(traceback.extract_stack(limit=30)):
        if "vllm_triforce" in frame.filename:
            return f"{frame.filename.split('vllm_triforce/')[-1]}:{frame.lineno} {frame.name}"
    return "?"


if __name__ == "__main__":
    main()
