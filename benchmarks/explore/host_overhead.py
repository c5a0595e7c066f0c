"""TriForce's own host time per middle round, on a target whose compute is negligible.

Issue 25's measure of the overhead a GPU cannot hide: a 30-layer Llama of hidden size 64
and a 1,024-token vocabulary (built here, tests/tiny_models.py), two levels, batch 8,
fixed depth, greedy (`--temperature`: sampled, every request seeded unless `--unseeded`).
Host ms per round = (time in `propose` - time in model forwards) / middle rounds
(engine/stats.py), over the timed generations; syncs per round and per step come from one
more, untimed generation (vllm_triforce/tools/bench/syncs.py), where the tree has it.
`--ops N`: one more generation counts the aten operations per middle round outside the
model forwards (each a launch on a GPU; unlike milliseconds on a shared host, the count
does not move between runs), and prints the N vllm_triforce call sites whose operations
took the most host time (tools/bench/host_ops.py). `--round-graphs`: the middle passes
over persistent buffers, and one more generation times the host's work from a round's
copy to the host to the next round's replay (what a GPU waits through).
`--compiled-selection`: the block scores, the re-ranking and the pass layout compiled
(core/compiled.py). `--selection-graphs` (with both): a round's re-selection and the next
pass's load as one graph (`selection_graphs`; engine/device/selection_graph.py).
`--compiled-sampling` (with `--temperature`): a sampled round's vocabulary work compiled
(`compiled_sampling`; core/compiled_sampling.py).

    .venv/bin/python benchmarks/explore/host_overhead.py [--repeats 3] [--levels 2]
        [--round-graphs] [--compiled-selection] [--selection-graphs] [--ops 40]
        [--temperature 0.8 [--unseeded] [--compiled-sampling]]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-words", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--levels", type=int, choices=(2, 3), default=2)
    parser.add_argument("--refresh-interval", type=int, default=1,
                        help="1 (default): re-select between middle rounds; 0: never")
    parser.add_argument("--round-graphs", action="store_true",
                        help="the middle passes over persistent buffers (`round_graphs`)")
    parser.add_argument("--compiled-selection", action="store_true",
                        help="the block scores, re-ranking and pass layout compiled "
                             "(`compiled_selection`)")
    parser.add_argument("--selection-graphs", action="store_true",
                        help="with both above: a round's re-selection and the next pass's "
                             "load as one graph (`selection_graphs`)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy; above 0 every request samples (the "
                             "rounds' vocabulary work: probabilities, draws, the hand-off)")
    parser.add_argument("--unseeded", action="store_true",
                        help="with --temperature: requests without a seed (a serving "
                             "load's usual case: one batched draw), not each seeded")
    parser.add_argument("--compiled-sampling", action="store_true",
                        help="a sampled round's distributions, verification and draws "
                             "compiled (`compiled_sampling`)")
    parser.add_argument("--no-syncs", action="store_true", help="skip the counted generation")
    parser.add_argument("--ops", type=int, default=0, metavar="N",
                        help="count aten operations per middle round; print N call sites")
    args = parser.parse_args()

    import tiny_models
    from vllm import SamplingParams

    from vllm_triforce.offline import drafter_of, in_process_llm

    tmp = Path(tempfile.mkdtemp(prefix="host_overhead_"))
    target = tiny_models.build_tiny_llama(tmp / "target", num_layers=30, hidden=64, heads=2,
                                          kv_heads=2, vocab_size=1024)
    spec = {"method": "triforce", "num_speculative_tokens": 6, "retrieval_budget": 256,
            "retrieval_sink_tokens": 32, "retrieval_recent_tokens": 64, "adaptive": False,
            "refresh_interval": args.refresh_interval, "round_graphs": args.round_graphs,
            "compiled_selection": args.compiled_selection,
            "selection_graphs": args.selection_graphs,
            "compiled_sampling": args.compiled_sampling}
    if args.levels == 3:
        draft = tiny_models.build_tiny_llama_draft(tmp / "draft", vocab_size=1024)
        spec.update(model=str(draft), draft_window_tokens=96)
    llm = in_process_llm(target, spec, dtype="float32", enforce_eager=True, block_size=32,
                         max_model_len=2048, seed=0)
    prompts = [tiny_models.make_text(args.prompt_words, seed=i) for i in range(args.batch)]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            ignore_eos=True,
                            seed=None if args.temperature == 0 or args.unseeded else 0)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    drafter = drafter_of(llm)
    host_ms, wall = [], []
    for _ in range(args.repeats):
        before = drafter.stats.snapshot()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall.append(time.perf_counter() - start)
        after = drafter.stats.snapshot()
        d = {k: after[k] - before[k] for k in ("middle_seconds", "forward_seconds",
                                               "middle_rounds", "top_proposed")}
        assert d["top_proposed"] > 0, "TriForce never drafted"
        host_ms.append(1000 * (d["middle_seconds"] - d["forward_seconds"]) / d["middle_rounds"])
    print(f"{args.levels} levels, batch {args.batch}, refresh_interval "
          f"{args.refresh_interval}: host ms per middle round "
          f"{statistics.median(host_ms):.2f} (repeats {', '.join(f'{h:.2f}' for h in host_ms)}); "
          f"generate {statistics.median(wall):.2f} s")
    if args.round_graphs:
        time_copy_to_replay(llm, drafter, prompts, params)
    if args.ops:
        count_operations(llm, drafter, prompts, params, args.ops)
    try:
        from vllm_triforce.tools.bench.syncs import ProposeSyncs, summarise
    except ImportError:
        return
    if args.no_syncs:
        return
    with ProposeSyncs(drafter) as recorder:
        llm.generate(prompts, params, use_tqdm=False)
    s = summarise(recorder.take())
    print(f"syncs: max {s['max_round']} per round, max {s['max_step']} per step "
          f"(mean {s['mean_round']:.1f} / {s['mean_step']:.1f})")


def time_copy_to_replay(llm, drafter, prompts, params) -> None:
    """With round graphs: the host's time from a middle round's copy to the host to the
    next round's replay, in the same step. On a GPU the device idles through it (the copy
    waited for the device's work to end); what the host does before the copy overlaps
    the device's work."""
    from vllm_triforce.engine import middle
    from vllm_triforce.engine.device import round_graph

    on_host, replay, propose = middle._on_host, round_graph.RoundGraphs._replay, drafter.propose
    copied, gaps = [None], []

    def timed_on_host(t):
        out = on_host(t)
        copied[0] = time.perf_counter()
        return out

    def timed_replay(self, *args):
        if copied[0] is not None:
            gaps.append(time.perf_counter() - copied[0])
            copied[0] = None
        return replay(self, *args)

    def step_propose(*args, **kwargs):
        copied[0] = None
        return propose(*args, **kwargs)

    middle._on_host, round_graph.RoundGraphs._replay = timed_on_host, timed_replay
    drafter.propose = step_propose
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        middle._on_host, round_graph.RoundGraphs._replay = on_host, replay
        drafter.propose = propose
    print(f"host ms from a round's copy to the next round's replay: median "
          f"{1000 * statistics.median(gaps):.3f} over {len(gaps)} rounds")


def count_operations(llm, drafter, prompts, params, top: int) -> None:
    """Aten operations per middle round outside the model forwards, by call site, with the
    host time each site's operations took (tools/bench/host_ops.py)."""
    from vllm_triforce.tools.bench.host_ops import HostOps

    before = drafter.stats.snapshot()["middle_rounds"]
    with HostOps(drafter) as ops:
        llm.generate(prompts, params, use_tqdm=False)
    rounds = drafter.stats.snapshot()["middle_rounds"] - before
    summary = ops.summary(rounds, top)
    print(f"aten operations outside model forwards: {summary['ops_per_round']:.1f} per middle "
          f"round, {summary['host_ms_per_round']:.3f} host ms ({ops.total} over {rounds} "
          f"rounds; commit, selection and hand-off included)")
    for site in summary["sites"]:
        print(f"{site['ops']:7.1f} {site['host_ms']:8.4f} ms  {site['site']}")


if __name__ == "__main__":
    main()
