"""The exact bytes of a quantized KV cache as a formula of its shape, checked against the real tensors in tests, and
the bf16 cache it is compared to."""

from toolkit.kv.config import KVQuantConfig


def quantized_kv_bytes(cfg: KVQuantConfig, tokens: int, layers: int, batch: int, kv_heads: int, head_dim: int,
                       residual_bytes: int = 2) -> int:
    """Bytes of a `QuantizedKVCache` holding `tokens` per sequence: per (layer, sequence, head)
        codes        2 * Tq * head_dim * bits / 8                     (keys and values)
        key scales   2 * (Tq / G) * head_dim * 2                      (fp16 scale and minimum per channel per group)
        value scales 2 * Tq * (head_dim / min(G, head_dim)) * 2        (fp16 scale and minimum per token per group)
        residual     2 * (tokens - Tq) * head_dim * residual_bytes
        shadow       2 * G * head_dim * residual_bytes, once a group was flushed (cfg.crop_shadow)
    with Tq = cfg.flushed_tokens(tokens); residual_bytes is the activations' element size (4 fp32, 2 bf16)."""
    G, tq = cfg.group_size, cfg.flushed_tokens(tokens)
    vg = min(G, head_dim)
    per_head = 2 * tq * head_dim * cfg.bits // 8
    per_head += 2 * (tq // G) * head_dim * 2 + 2 * tq * (head_dim // vg) * 2
    per_head += 2 * (tokens - tq) * head_dim * residual_bytes
    if cfg.crop_shadow and tq:
        per_head += 2 * G * head_dim * residual_bytes
    return per_head * layers * batch * kv_heads


def bf16_kv_bytes(tokens: int, layers: int, batch: int, kv_heads: int, head_dim: int) -> int:
    return 2 * tokens * head_dim * 2 * layers * batch * kv_heads


def model_kv_shape(model) -> dict:
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return {"layers": config.num_hidden_layers, "kv_heads": kv_heads, "head_dim": head_dim}
