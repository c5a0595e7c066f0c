"""Host microseconds the depth controller takes for one step it keeps plain, by batch size.

What a plain step past the retrieval budget costs TriForce on the host when the controller
is asked during vLLM's pass (engine/plain_steps.py `PlainSteps.plan_ahead`): the plan made
ahead, the step's `begin` (the controller hears the last step), `take_plan_ahead` and `end`,
for R requests whose contexts outgrew the budget, none seeded or plain, nothing verified. No
engine and no model: engine/depth.DepthChooser alone, so the figure is the controller's own
and scales with R only through its per-request work. Median of each block of 100 steps after
200 warm-up steps, the best of five blocks (the host's load moves the others).

    .venv/bin/python benchmarks/explore/plan_cost.py [--batches 8 32 128]

Run it on two trees to compare them (the tree before a change unpacked as in
fixed_depth_counts.py, then `PYTHONPATH=/tmp/old`).
"""

import argparse
import statistics
import time

from vllm_triforce.config import BlockCounts
from vllm_triforce.engine import depth as depth_module
from vllm_triforce.engine.stats import TriForceStats


def plain_step_us(num_reqs: int) -> float:
    blocks = BlockCounts(block_size=16, budget_blocks=16, retrieval_sink_blocks=1,
                         retrieval_recent_blocks=1)
    chooser = depth_module.DepthChooser(6, False, TriForceStats(), None, blocks=blocks,
                                        max_drafting=num_reqs)
    req_ids = [f"r{i}" for i in range(num_reqs)]
    committed = [4000 + i for i in range(num_reqs)]  # 251+ blocks: past the 16-block budget
    plain = [False] * num_reqs
    verified = getattr(depth_module, "Verified", None)  # a tree before it took a list
    none = verified.none() if verified else []

    def step() -> None:
        chooser.plan_ahead(req_ids, 6, committed, plain)
        taken = chooser.begin(time.perf_counter(), req_ids, num_tokens=num_reqs,
                              emitted=num_reqs, pure_decode=True, verified=none,
                              live_req_ids=req_ids)
        taken.take_plan_ahead(req_ids)
        taken.end(drafting=False)

    for _ in range(200):
        step()
    seconds = []
    for _ in range(500):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return 1e6 * min(statistics.median(seconds[i:i + 100]) for i in range(0, 500, 100))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 128])
    args = parser.parse_args()
    for num_reqs in args.batches:
        print(f"batch {num_reqs:4d}: {plain_step_us(num_reqs):6.1f} us per plain step")


if __name__ == "__main__":
    main()
