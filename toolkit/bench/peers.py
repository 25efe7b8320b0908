"""The peer a user would otherwise reach for beside `spec=lookup`: transformers' assisted generation with its
prompt-lookup draft (`generate(prompt_lookup_num_tokens=k)`), timed against transformers' plain `generate()` on the
same float model in fp32, interleaved, greedy, exactly `new_tokens` tokens each. It runs on transformers' own
cache and float weights (it cannot run our quantized ones), so it is one peer row per float model.

Assisted generation streams accepted tokens in bursts, so its figures are wall-clock: TTFT is the time to the
first streamed chunk, decode tokens/s the tokens after it over the time after it."""

import statistics
import time

from toolkit.bench.baseline import hf_generate_timed
from toolkit.bench.interleave import interleaved


def _timed(model, ids, new_tokens, **kwargs):
    start = time.perf_counter()
    tokens, timing = hf_generate_timed(model, ids, new_tokens, **kwargs)
    return tokens, time.perf_counter() - start, timing.ttft_s


def _summary(totals: list[float], ttfts: list[float], new_tokens: int) -> dict:
    runs = len(totals)
    return {"runs": runs, "tokens_per_s": runs * new_tokens / sum(totals), "ttft_ms": 1000 * statistics.mean(ttfts),
            "decode_tokens_per_s": runs * (new_tokens - 1) / (sum(totals) - sum(ttfts))}


def assisted_lookup_peer(model, prompts: list[list[int]], new_tokens: int, k: int, repeats: int, warmup: int) -> dict:
    """{"generate": {...}, "assisted": {...}, "speedup_vs_generate", "identical_outputs", "k"}."""
    paths = {"generate": lambda ids: _timed(model, ids, new_tokens),
             "assisted": lambda ids: _timed(model, ids, new_tokens, prompt_lookup_num_tokens=k)}
    totals, ttfts, outputs = ({name: [] for name in paths} for _ in range(3))
    for _, name, ids in interleaved(paths, prompts, repeats, warmup):
        tokens, total, ttft = paths[name](ids)
        totals[name].append(total)
        ttfts[name].append(ttft)
        outputs[name].append(tokens)
    return {"k": k, "new_tokens": new_tokens,
            **{name: _summary(totals[name], ttfts[name], new_tokens) for name in paths},
            "speedup_vs_generate": sum(totals["generate"]) / sum(totals["assisted"]),
            "identical_outputs": outputs["generate"] == outputs["assisted"]}
