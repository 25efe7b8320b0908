"""Section 3, the bound: FLOPs and bytes moved per token for prefill and for decode, set against this machine's
measured peak matmul FLOP/s and memory bandwidth (the roofline model).

A path whose arithmetic intensity (FLOPs per byte) is above the ridge point (peak FLOP/s / bandwidth) can at best
run at peak FLOP/s: compute-bound. Below it, at best at intensity x bandwidth: memory-bound. `times_roofline` is
how many times slower than that best the measured path ran (1.0 = on the roofline).

Counted: every matmul weight (2 FLOPs per weight per token) and attention's two products with the cache (QK^T and
AV, 2 x 2 x heads x head_dim FLOPs per cached token); bytes are weights read plus KV read/written. Norms, rotary
embeddings and activations are left out: they are small beside these on every model the toolkit runs.
"""

import torch

from toolkit.engine.costs import weight_bytes_per_token
from toolkit.machine import measure_matmul_flops, measure_memory_bandwidth
from toolkit.quant.qlinear import QuantLinear


def _linear_shapes(model) -> dict[str, tuple[int, int]]:

    return {name: (m.in_features, m.out_features) for name, m in model.named_modules()
            if isinstance(m, (torch.nn.Linear, QuantLinear))}


def matmul_params(model) -> tuple[int, int]:
    """(weights of every matmul except the output head, weights of the output head)."""
    head = model.get_output_embeddings()
    head_name = next((n for n, m in model.named_modules() if m is head), None)
    shapes = _linear_shapes(model)
    head_params = head.weight.numel() if head_name not in shapes else shapes[head_name][0] * shapes[head_name][1]
    body = sum(i * o for n, (i, o) in shapes.items() if n != head_name)
    return body, head_params


def attention_width(model) -> tuple[int, int]:
    """(layers, query heads x head dim)."""
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_attention_heads * head_dim


def prefill_flops_per_token(model, prompt_tokens: int) -> float:
    """Per prompt token: every body matmul; the head once per prompt (the engine keeps only the last position's
    logits); attention over the causal prefix (on average (T + 1) / 2 earlier tokens)."""
    body, head = matmul_params(model)
    layers, width = attention_width(model)
    return 2 * body + 2 * head / prompt_tokens + 4 * layers * width * (prompt_tokens + 1) / 2


def decode_flops_per_token(model, context: float) -> float:
    body, head = matmul_params(model)
    layers, width = attention_width(model)
    return 2 * (body + head) + 4 * layers * width * context


def path_bound(flops: float, bytes_moved: float, seconds_per_token: float, peak_flops: float,
               bandwidth: float) -> dict:
    intensity = flops / bytes_moved
    ridge = peak_flops / bandwidth
    attainable = min(peak_flops, intensity * bandwidth)
    achieved = flops / seconds_per_token
    return {
        "flops_per_token": flops,
        "bytes_per_token": bytes_moved,
        "intensity_flops_per_byte": intensity,
        "ridge_flops_per_byte": ridge,
        "bound": "compute" if intensity >= ridge else "memory",
        "achieved_gflops": achieved / 1e9,
        "achieved_gbs": bytes_moved / seconds_per_token / 1e9,
        "roofline_gflops": attainable / 1e9,
        "times_roofline": attainable / achieved,
    }


def roofline(model, kv_bytes_per_token: float, prompt_tokens: float, new_tokens: int, split: dict,
             peak_flops: float, bandwidth: float, held: int | None = None) -> dict:
    """Both paths of the workload measured in `split` (TTFT median, ITL median). `kv_bytes_per_token`: the cache's
    bytes per cached token (all layers, keys and values) at the kind the workload ran with; `held`: the most tokens
    the cache holds (a windowed cache's capacity, kv.window), None for all of them."""
    weights = weight_bytes_per_token(model)
    t = max(1, round(prompt_tokens))
    context = prompt_tokens + new_tokens / 2  # mean cache length a decode step reads
    if held is not None:
        context = min(context, held)
    # prefill reads each weight once per prompt and writes every token's keys and values
    prefill_bytes = weights / t + kv_bytes_per_token
    decode_kv = kv_bytes_per_token * context
    prefill = path_bound(prefill_flops_per_token(model, t), prefill_bytes, split["ttft_ms"] / 1e3 / t, peak_flops,
                         bandwidth)
    decode = path_bound(decode_flops_per_token(model, context), weights + decode_kv, split["itl_ms"] / 1e3,
                        peak_flops, bandwidth)
    decode.update(weight_bytes=weights, kv_bytes=decode_kv, context_tokens=context)
    prefill.update(weight_bytes_per_prompt=weights, prompt_tokens=t)
    return {"peak_gflops": peak_flops / 1e9, "bandwidth_gbs": bandwidth / 1e9, "prefill": prefill, "decode": decode}


def measure_peaks(quick: bool = True) -> tuple[float, float]:
    """(matmul FLOP/s in the engine's activation dtype fp32, read bandwidth bytes/s), briefly."""

    return (measure_matmul_flops(n=1024, repeats=3 if quick else 5),
            measure_memory_bandwidth(gib=0.25 if quick else 0.5, repeats=3 if quick else 5))
