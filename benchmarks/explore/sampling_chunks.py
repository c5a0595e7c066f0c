"""`sampling_probs` by chunks of rows: time and peak memory per chunk size (issue 25).

Top-p 0.9 and temperature 0.8 over a 128,256-token vocabulary (Llama-3.1-8B), bf16 logits,
for several row counts (a middle round's pass holds batch x (gamma1 + 1) rows). Each
setting runs once to warm up, then `--repeats` times: median device ms (CUDA events), host
ms of the call, and the peak memory allocated beyond the inputs. Needs only torch.

    python3 benchmarks/explore/sampling_chunks.py [--rows 56 224 448] [--chunks 16 32 64 128 0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vllm_triforce.core import verify  # noqa: E402

VOCAB = 128_256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[56, 224, 448])
    parser.add_argument("--chunks", type=int, nargs="+", default=[16, 32, 64, 128, 0],
                        help="rows per chunk; 0: all rows at once")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    print(f"{dev} {torch.cuda.get_device_name() if cuda else ''} torch {torch.__version__}")
    for rows in args.rows:
        logits = torch.randn(rows, VOCAB, device=dev, dtype=torch.bfloat16) * 3
        temperature = torch.full((rows,), 0.8, device=dev)
        top_p = torch.full((rows,), 0.9, device=dev)
        reference = None
        for chunk in args.chunks:
            verify.SAMPLING_CHUNK_ROWS = chunk or rows

            def call():
                return verify.sampling_probs(logits, temperature, None, top_p, all_greedy=False)

            out = call()
            if reference is None:
                reference = out
            assert torch.equal(out, reference), "chunks changed the values"
            del out
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            device_ms, host_ms = [], []
            for _ in range(args.repeats):
                if cuda:
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    torch.cuda.synchronize()
                    start.record()
                t0 = time.perf_counter()
                out = call()
                host_ms.append(1000 * (time.perf_counter() - t0))
                if cuda:
                    end.record()
                    torch.cuda.synchronize()
                    device_ms.append(start.elapsed_time(end))
                del out
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else 0.0
            dm = f"{statistics.median(device_ms):7.3f}" if device_ms else "      -"
            print(f"rows {rows:4d} chunk {chunk or 'all':>4}: device {dm} ms  host "
                  f"{statistics.median(host_ms):7.3f} ms  peak +{peak:7.1f} MiB", flush=True)


if __name__ == "__main__":
    main()
