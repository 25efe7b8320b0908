"""The peer a user would otherwise reach for beside `spec=lookup` and `spec=draft`: transformers' assisted
generation, with its prompt-lookup draft (`generate(prompt_lookup_num_tokens=k)`) or with a draft model
(`generate(assistant_model=draft)`), timed against transformers' plain `generate()` on the same float model in
fp32, interleaved, greedy, exactly `new_tokens` tokens each. It runs on transformers' own cache and float weights
(it cannot run our quantized ones), so it is one peer row per float model (and draft).

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


def _assisted_peer(model, prompts: list[list[int]], new_tokens: int, repeats: int, warmup: int, **assist) -> dict:
    paths = {"generate": lambda ids: _timed(model, ids, new_tokens),
             "assisted": lambda ids: _timed(model, ids, new_tokens, **assist)}
    totals, ttfts, outputs = ({name: [] for name in paths} for _ in range(3))
    for _, name, ids in interleaved(paths, prompts, repeats, warmup):
        tokens, total, ttft = paths[name](ids)
        totals[name].append(total)
        ttfts[name].append(ttft)
        outputs[name].append(tokens)
    return {"new_tokens": new_tokens,
            **{name: _summary(totals[name], ttfts[name], new_tokens) for name in paths},
            "speedup_vs_generate": sum(totals["generate"]) / sum(totals["assisted"]),
            "identical_outputs": outputs["generate"] == outputs["assisted"]}


# The peer's prompt-lookup draft length: transformers' own default (PromptLookupCandidateGenerator's
# num_output_tokens), what a user gets who turns it on, rather than ours (spec.k=16 is tuned to our length rule,
# which proposes the full k only after an agreeing match; transformers always proposes k: 0.73x at k=16 here).
TRANSFORMERS_LOOKUP_TOKENS = 10


def assisted_lookup_peer(model, prompts: list[list[int]], new_tokens: int, k: int, repeats: int, warmup: int) -> dict:
    """{"generate": {...}, "assisted": {...}, "speedup_vs_generate", "identical_outputs", "k"}."""
    return {"k": k, **_assisted_peer(model, prompts, new_tokens, repeats, warmup, prompt_lookup_num_tokens=k)}


def assisted_draft_peer(model, assistant, prompts: list[list[int]], new_tokens: int, repeats: int,
                        warmup: int) -> dict:
    """The same figures for `assistant` drafting for `model`, at transformers' own settings for it (the
    assistant's generation config: by default up to 20 tokens a round, stopping early when the draft's
    confidence drops below an adaptive threshold, 0.4 at the start): what a user of assisted generation gets."""
    config = assistant.generation_config
    # unset keys take transformers' global defaults when generate() runs: report those
    defaults = getattr(config, "_get_default_generation_params", dict)()
    settings = {key: getattr(config, key, None) if getattr(config, key, None) is not None else defaults.get(key)
                for key in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")}
    return {"assistant_settings": settings,
            **_assisted_peer(model, prompts, new_tokens, repeats, warmup, assistant_model=assistant)}
