"""Everything a fixed-depth TriForce engine does, as one JSON line: to show a change to the
engine's code changed none of it.

SmolLM2-135M, float32, eager, three 3,000-token Moby-Dick prompts, 64 new tokens, `adaptive`
off (every request drafts gamma2 every step, so no clock decides anything): the tokens and
every integer counter of the proposer. Two levels with greedy requests; `--three-level`:
SmolLM2 as its own small draft (gamma1 2), one greedy request and two seeded sampled ones.
Run it on two trees and compare the lines, e.g. the tree before a change, unpacked with its
`patches/` linked as `vllm_triforce/patches`, or with and without `--round-graphs` or
`--compiled-sampling`:

    git archive <rev> | tar -x -C /tmp/old && ln -s /tmp/old/patches /tmp/old/vllm_triforce/patches
    PYTHONPATH=/tmp/old .venv/bin/python benchmarks/explore/fixed_depth_counts.py | tail -1 > old.json
    .venv/bin/python benchmarks/explore/fixed_depth_counts.py | tail -1 > new.json
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--three-level", action="store_true")
    parser.add_argument("--round-graphs", action="store_true",
                        help="the middle passes over persistent buffers (`round_graphs`); "
                             "its own counters (round_graph_*) are left out of the line")
    parser.add_argument("--compiled-sampling", action="store_true",
                        help="a sampled round's probs, verify and draws as compiled functions "
                             "(`compiled_sampling`; the sampled requests are `--three-level`'s)")
    args = parser.parse_args()

    from transformers import AutoTokenizer
    from vllm import SamplingParams

    import vllm_triforce
    from vllm_triforce import assets
    from vllm_triforce.offline import drafter_of, in_process_llm

    model = assets.ensure_model("smollm2-135m")
    ids = AutoTokenizer.from_pretrained(str(model))(assets.moby_dick_text())["input_ids"]
    prompts = [{"prompt_token_ids": ids[i * 9000: i * 9000 + 3000]} for i in range(3)]
    # coded summaries, named: a CPU's default became float ones, and the line stays
    # comparable with the trees before that
    spec = {"method": "triforce", "num_speculative_tokens": 5, "retrieval_budget": 512,
            "adaptive": False, "compact_summaries": True}
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    params = [greedy] * 3
    if args.three_level:
        spec.update(model=str(model), draft_tokens_per_round=2, draft_window_tokens=480)
        params = [greedy] + [SamplingParams(temperature=0.8, top_p=0.9, seed=seed,
                                            max_tokens=64, ignore_eos=True) for seed in (1, 2)]
    if args.round_graphs:
        spec["round_graphs"] = True
    if args.compiled_sampling:
        spec["compiled_sampling"] = True
    llm = in_process_llm(model, spec, dtype="float32", enforce_eager=True, block_size=32, seed=0,
                         max_model_len=4096)
    outs = llm.generate(prompts, params, use_tqdm=False)
    counts = {k: v for k, v in drafter_of(llm).stats.snapshot().items()
              if isinstance(v, int) and "seconds" not in k and not k.startswith("round_graph")}
    print(json.dumps({"tree": vllm_triforce.__file__,
                      "tokens": [list(o.outputs[0].token_ids) for o in outs],
                      "counts": counts}))


if __name__ == "__main__":
    main()
