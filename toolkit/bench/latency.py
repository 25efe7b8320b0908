"""`specquant bench`: the engine's prefill and decode latency against transformers' generate(), interleaved.

Both paths run the same prompts with the same threads in one process, alternating which goes first, because this
machine is noisy: only ratios measured side by side mean anything. Each path generates exactly `new_tokens`
tokens (end-of-sequence ignored) so decode rates compare like with like.
"""

import statistics

import torch

from toolkit.bench.baseline import hf_generate_timed
from toolkit.bench.interleave import interleaved
from toolkit.bench.repeats import Run, repeat_ratios
from toolkit.engine.costs import kv_bytes_per_token, weight_bytes_per_token  # noqa: F401 (bench's names)
from toolkit.engine.generate import generate
from toolkit.engine.precision import model_precision
from toolkit.errors import InputError
from toolkit.evaluation.generation import token_agreement
from toolkit.kv import KVSpec
from toolkit.model_state import peek
from toolkit.timing import GenerationTiming, RssSampler, percentiles


def decode_floor(model, kv_per_token: float, context_tokens: float, bandwidth: float) -> dict:
    """The fastest a decode step can be if it only had to stream its bytes at the measured bandwidth: the weights,
    and `kv_per_token` bytes of KV cache for each token of context."""
    weights = weight_bytes_per_token(model)
    kv = kv_per_token * context_tokens
    seconds = (weights + kv) / bandwidth
    return {"weight_bytes": weights, "kv_bytes_at_mean_context": int(kv), "floor_ms": seconds * 1e3,
            "floor_tokens_per_s": 1 / seconds}


def summarize(timings: list[GenerationTiming], peak_rss_mb: float, **extra) -> dict:
    """Pool runs: TTFT median, ITL percentiles over every step, decode rate = decode tokens / decode time."""
    itl = [s for t in timings for s in t.itl_s]
    decode_s = sum(t.decode_s for t in timings)
    return {
        **extra,
        "prompt_tokens": timings[0].prompt_tokens,
        "new_tokens": timings[0].new_tokens,
        "runs": len(timings),
        "ttft_ms": statistics.median(t.ttft_s for t in timings) * 1e3,
        "itl_ms": {k: v * 1e3 for k, v in percentiles(itl).items()},
        "decode_tokens_per_s": len(itl) / decode_s if decode_s else float("nan"),
        "peak_rss_mb": peak_rss_mb,
    }


def run_latency_bench(engine_model, tokenizer, reference_model, prompts: list[list[int]], new_tokens: int,
                      repeats: int, warmup: int, bandwidth: float, kv: KVSpec | None = None, llamacpp=None) -> dict:
    """Time the engine on `engine_model` and transformers' generate() on `reference_model` (None: no baseline),
    both already in their dtypes, on token-id prompts, and llama.cpp (`toolkit.bench.llamacpp.LlamaCpp`, or None)
    on the same prompts, all interleaved. `kv`: the engine's KV cache (a KVSpec; None = fp)."""
    if repeats < 1 or new_tokens < 2:
        raise InputError("bench needs repeats >= 1 and new_tokens >= 2 (one inter-token latency at least)",
                         "raise repeats / new_tokens")
    kv_seen = []  # (tokens, bytes) the engine's KV cache held at the end of each run
    paths = {"engine": lambda ids: _engine_run(engine_model, tokenizer, ids, new_tokens, kv, kv_seen)}
    if reference_model is not None:
        paths["baseline"] = lambda ids: hf_generate_timed(reference_model, ids, new_tokens)
    if llamacpp is not None:
        paths["llamacpp"] = lambda ids: llamacpp.run(ids, new_tokens)

    timings = {name: [] for name in paths}
    runs = {name: [] for name in paths}
    outputs = {name: [] for name in paths}
    peaks = dict.fromkeys(paths, 0.0)
    for rep, name, ids in interleaved(paths, prompts, repeats, warmup):
        with RssSampler() as rss:
            tokens, timing = paths[name](ids)
        peaks[name] = max(peaks[name], rss.peak_mb)
        timings[name].append(timing)
        runs[name].append(Run(rep, timing.ttft_s, len(timing.itl_s), timing.decode_s))
        if rep == 0:
            outputs[name].append(tokens)

    mean_context = statistics.mean(len(ids) for ids in prompts) + new_tokens / 2
    kv_tokens, kv_bytes = max(kv_seen)
    result = _path_summary(engine_model, timings["engine"], peaks["engine"], mean_context, bandwidth,
                           kv_per_token=kv_bytes / kv_tokens)
    result.update(kv_tokens=kv_tokens, kv_bytes=kv_bytes,
                  kv_ratio_to_bf16=kv_bytes / (kv_bytes_per_token(engine_model, torch.bfloat16) * kv_tokens))
    if reference_model is not None:
        result["baseline"] = _path_summary(reference_model, timings["baseline"], peaks["baseline"], mean_context,
                                           bandwidth, name="transformers generate()")
        result["speedup_vs_baseline"] = result["decode_tokens_per_s"] / result["baseline"]["decode_tokens_per_s"]
        result["ttft_speedup_vs_baseline"] = result["baseline"]["ttft_ms"] / result["ttft_ms"]
        result["greedy_token_agreement_vs_baseline"] = token_agreement(outputs["engine"], outputs["baseline"])
    if llamacpp is not None:
        theirs = summarize(timings["llamacpp"], peaks["llamacpp"], name="llama.cpp", dtype=llamacpp.describe())
        theirs["weights"] = llamacpp.weights  # "same weights" (our export) or which requantized file it ran
        theirs["gguf"] = str(llamacpp.path)
        theirs["kv_type"] = llamacpp.kv_type
        if llamacpp.fallback_reason:
            theirs["fallback_reason"] = llamacpp.fallback_reason
        # its floor as the engine's: the GGUF's bytes, and its KV cache's (f16, or q8_0 / q4_0 blocks) at the mean
        # context
        kv_token = kv_bytes_per_token(engine_model, torch.float16) / 2 * llamacpp.kv_bytes_per_element()
        seconds = (llamacpp.weight_bytes() + kv_token * mean_context) / bandwidth
        theirs["decode_floor"] = {"weight_bytes": llamacpp.weight_bytes(), "floor_tokens_per_s": 1 / seconds,
                                  "times_floor": 1 / seconds / theirs["decode_tokens_per_s"]}
        result["llamacpp"] = theirs
        result["speedup_vs_llamacpp"] = result["decode_tokens_per_s"] / theirs["decode_tokens_per_s"]
        result["ttft_speedup_vs_llamacpp"] = theirs["ttft_ms"] / result["ttft_ms"]
        result["greedy_token_agreement_vs_llamacpp"] = token_agreement(outputs["engine"], outputs["llamacpp"])
        result["vs_llamacpp"] = repeat_ratios(runs["engine"], runs["llamacpp"])
    return result


def _path_summary(model, timings, peak_mb, mean_context, bandwidth, kv_per_token=None, **extra) -> dict:
    """`kv_per_token`: the bytes a token took in the engine's cache as stored (its floor reads those); None: the
    compute dtype's (transformers' cache)."""
    precision = model_precision(model)
    label = peek(model).quant_label
    if kv_per_token is None:
        kv_per_token = kv_bytes_per_token(model, precision.compute)
    summary = summarize(timings, peak_mb, **extra, dtype=f"{label} + {precision.name}" if label else precision.name,
                        decode_floor=decode_floor(model, kv_per_token, mean_context, bandwidth))
    # How many times slower than the bandwidth floor the measured decode step is (1.0 = at the floor).
    summary["decode_floor"]["times_floor"] = summary["decode_floor"]["floor_tokens_per_s"] / summary["decode_tokens_per_s"]
    return summary


def _engine_run(model, tokenizer, ids: list[int], new_tokens: int, kv: KVSpec | None = None, kv_seen=None):
    out = generate(model, tokenizer, [ids], new_tokens, stop_tokens=set(), kv=kv)
    if kv_seen is not None:  # the last sampled token is never fed back, so the cache holds one fewer
        kv_seen.append((len(ids) + len(out.sequences[0].token_ids) - 1, out.kv_bytes))
    return out.sequences[0].token_ids, out.timing


