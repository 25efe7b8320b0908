"""Section 2, TTFT vs ITL: which share of the end-to-end time the prompt (prefill, up to the first token) takes and
which the stream of later tokens (decode, the inter-token latencies) takes."""

import statistics

from toolkit.timing import GenerationTiming, percentiles


def time_split(timings: list[GenerationTiming]) -> dict:
    """Pooled over the runs of one option. The two shares are of the same total, so they sum to 1."""
    prefill = sum(t.ttft_s for t in timings)
    decode = sum(t.decode_s for t in timings)
    total = prefill + decode
    itl = [s for t in timings for s in t.itl_s]
    return {
        "runs": len(timings),
        "ttft_ms": statistics.median(t.ttft_s for t in timings) * 1e3,
        # the mean, not the median: a speculative round emits several tokens at once, and only the mean of its
        # spread-out latencies equals decode time / tokens, the figure speculation changes
        "itl_ms": decode / len(itl) * 1e3 if itl else float("nan"),
        "itl_p50_ms": percentiles(itl)["p50"] * 1e3,
        "itl_p90_ms": percentiles(itl)["p90"] * 1e3,
        "e2e_ms": total / len(timings) * 1e3,  # mean end-to-end time of one request
        "prefill_s": prefill,
        "decode_s": decode,
        "prefill_share": prefill / total if total else 0.0,
        "decode_share": decode / total if total else 0.0,
    }


def dominant(split: dict) -> str:
    """'prefill' (a slow start: fix TTFT) or 'decode' (a slow stream: fix ITL)."""
    return "prefill" if split["prefill_share"] >= split["decode_share"] else "decode"
