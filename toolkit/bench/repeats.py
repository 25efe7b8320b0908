"""Ratios against a peer (llama.cpp) per repeat, and their median: this machine is shared, so one pooled ratio can
ride on one slow minute; each repeat runs every prompt on both paths back to back (`interleaved`), so each repeat
gives a ratio measured side by side, and the median of three or more of them is the figure the report quotes
(docs/benchmarks.md)."""

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Run:
    """One timed generation: the repeat it belongs to, its TTFT, and the tokens after the first with their time."""
    repeat: int
    ttft_s: float
    decode_tokens: int
    decode_s: float


def _per_repeat(runs: list[Run]) -> dict[int, tuple[float, float]]:
    """repeat -> (decode tokens/s over the repeat's runs, mean TTFT in seconds)."""
    out = {}
    for rep in sorted({r.repeat for r in runs}):
        mine = [r for r in runs if r.repeat == rep]
        seconds = sum(r.decode_s for r in mine)
        rate = sum(r.decode_tokens for r in mine) / seconds if seconds else float("nan")
        out[rep] = (rate, statistics.mean(r.ttft_s for r in mine))
    return out


def repeat_ratios(ours: list[Run], theirs: list[Run]) -> dict:
    """Per repeat: our decode rate over theirs, and their TTFT over ours (both > 1 = we are faster); with the
    medians over the repeats both paths ran."""
    a, b = _per_repeat(ours), _per_repeat(theirs)
    reps = sorted(set(a) & set(b))
    if not reps:
        raise ValueError("no repeat was run by both paths")
    decode = [a[r][0] / b[r][0] for r in reps]
    ttft = [b[r][1] / a[r][1] for r in reps]
    return {"repeats": len(reps), "decode_median": statistics.median(decode), "ttft_median": statistics.median(ttft),
            "decode_runs": decode, "ttft_runs": ttft}
