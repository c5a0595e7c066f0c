"""One way to time a decode step, for plain vLLM and TriForce alike (bench speed's
calibration, bench gpu's cost table).

A `generate` of m new tokens costs a per-call overhead (admission, the prefix-cache hit's
recompute of the last prompt tokens, the first selection) plus its steps. Timing a short
and a long generate and dividing the difference by the difference of their step counts
leaves decode steps only, in steady state. The two calls alternate in pairs, and the step
is the median of the pairs' quotients, so a drift of the host cancels. Where that median
is not positive, the extra steps were lost in the host's noise (a tiny model on a busy
CPU: -2.7 ms and -12.4 ms were measured that way): the pairs run again with the long call
twice as long, up to `max_long` tokens, and a step still lost is reported as None, never
as a negative time.
"""

from __future__ import annotations

import statistics
from typing import Callable

# timed(max_tokens) -> (seconds, vLLM steps it took)
TimedCall = Callable[[int], "tuple[float, int]"]


def decode_step(timed: TimedCall, short: int, long: int, *, repeats: int = 3,
                max_long: int | None = None) -> dict:
    """{"step_s": seconds per decode step or None, "overhead_s": the short call's time
    beyond its steps, "long": the long call's tokens used, "pairs": the (seconds, steps)
    pairs}. `short` < `long` new tokens per request."""
    max_long = max_long or 8 * long
    while True:
        pairs = [(timed(short), timed(long)) for _ in range(repeats)]
        quotients = [(t_long - t_short) / (s_long - s_short)
                     for (t_short, s_short), (t_long, s_long) in pairs if s_long > s_short]
        step = statistics.median(quotients) if quotients else None
        if (step is not None and step > 0) or 2 * long > max_long:
            break
        long *= 2
    if step is not None and step <= 0:
        step = None
    overhead = (statistics.median(t - s * step for (t, s), _ in pairs)
                if step is not None else None)
    return {"step_s": step, "overhead_s": overhead, "long": long,
            "pairs": [[list(a), list(b)] for a, b in pairs]}
