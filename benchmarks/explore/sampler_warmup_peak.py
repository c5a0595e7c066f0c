"""vLLM's sampler warm-up peak at a number of requests: what a larger max_num_seqs takes
from the KV cache outside TriForce's reservation (issue 61).

vLLM's profile run ends with `_dummy_sampler_run`: the sampler over [max_num_seqs, V]
logits (top-k, top-p, penalties), twice. Its peak counts against the KV cache, so two
engines that differ only in max_num_seqs differ in KV blocks. This runs the same two
sampler calls on a CPU in a fresh process per size and prints the resident-memory peak
above the logits (glibc maps these large tensors and gives them back when freed, so the
peak is the calls' live peak). A GPU's sampler kernels differ; the figure is an estimate.

    .venv/bin/python benchmarks/explore/sampler_warmup_peak.py [--vocab 128256] [--rows 64 256]
"""

import argparse
import resource
import subprocess
import sys


def peak_mib(rows: int, vocab: int) -> float:
    """In this process: the two warm-up calls' peak above their input, in MiB."""
    from dataclasses import replace

    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    logits = torch.randn(rows, vocab, dtype=torch.bfloat16)

    def full(v):
        return torch.full((rows,), v)

    metadata = SamplingMetadata(  # as `_dummy_sampler_run` makes it
        temperature=full(0.5), all_greedy=False, all_random=False, top_p=full(0.9),
        top_k=full(vocab - 1), generators={}, max_num_logprobs=None, logprob_token_ids=None,
        no_penalties=True, prompt_token_ids=None, frequency_penalties=full(0.1),
        presence_penalties=full(0.1), repetition_penalties=full(0.1),
        output_token_ids=[[] for _ in range(rows)], spec_token_ids=[[] for _ in range(rows)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    sampler = Sampler()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sampler(logits=logits, sampling_metadata=metadata)
    sampler(logits=logits, sampling_metadata=replace(
        metadata, generators={0: torch.Generator().manual_seed(0)}))
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128_256)  # Llama-3.1-8B's
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child's size
    args = parser.parse_args()
    if args.one:
        print(peak_mib(args.one, args.vocab))
        return
    peaks = {}
    for rows in args.rows:  # a fresh process each: ru_maxrss only grows
        out = subprocess.run([sys.executable, __file__, "--one", str(rows), "--vocab",
                              str(args.vocab)], capture_output=True, text=True, check=True)
        peaks[rows] = float(out.stdout.strip().splitlines()[-1])
        print(f"max_num_seqs {rows}: sampler warm-up peak {peaks[rows]:.0f} MiB above its "
              f"logits (vocabulary {args.vocab:,})")
    low, high = min(peaks), max(peaks)
    print(f"{high} against {low}: {peaks[high] - peaks[low]:.0f} MiB more, "
          f"{(peaks[high] - peaks[low]) / 2:.0f} KV blocks of Llama-3.1-8B (2 MiB each)")


if __name__ == "__main__":
    main()
