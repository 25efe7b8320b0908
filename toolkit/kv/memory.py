"""The exact bytes of a quantized KV cache as a formula of its shape, checked against the real tensors in tests, and
the bf16 cache it is compared to."""

from toolkit.kv.config import KVQuantConfig


def quantized_kv_bytes(cfg: KVQuantConfig, tokens: int, layers: int, batch: int, kv_heads: int, head_dim: int,
                       residual_bytes: int = 2) -> int:
    """Bytes of a `QuantizedKVCache` holding `tokens` per sequence: per (layer, sequence, head), with
    Tk = cfg.flushed_tokens(tokens) grouped keys, Tv = cfg.flushed_values(tokens) quantized values and staged keys
    up to Tv, Gv = min(G, head_dim) channels per value (and staged key) scale, S = cfg.rollback:
        key codes      Tk * head_dim * bits / 8
        value codes    Tv * head_dim * bits / 8
        key scales     (Tk / G) * head_dim * 2 * 2             (fp16 scale and minimum per channel per group)
        value scales   Tv * (head_dim / Gv) * 2 * 2            (fp16 scale and minimum per token per channel group)
        staged keys    (Tv - Tk) * (head_dim + (head_dim / Gv) * 2 * 2)   (INT8 per token until a group fills)
        full precision 2 * (tokens - Tv) * head_dim * residual_bytes
        sink           2 * min(cfg.sink, Tv) * head_dim * residual_bytes  (the first tokens' originals)
        shadows        with cfg.crop_shadow: 2 * min(cfg.value_shadow, Tv) * head_dim * residual_bytes, and the
                       staged codes of the last group (G tokens, as staged keys) while tokens < Tk + R + S
    residual_bytes is the activations' element size (4 fp32, 2 bf16)."""
    G, R, S = cfg.group_size, cfg.residual, cfg.rollback
    tk, tv = cfg.flushed_tokens(tokens), cfg.flushed_values(tokens)
    scales_per_token = (head_dim // min(G, head_dim)) * 2 * 2
    staged_per_token = head_dim + scales_per_token
    per_head = (tk + tv) * head_dim * cfg.bits // 8
    per_head += (tk // G) * head_dim * 2 * 2 + tv * scales_per_token + (tv - tk) * staged_per_token
    per_head += 2 * (tokens - tv) * head_dim * residual_bytes
    per_head += 2 * min(cfg.sink, tv) * head_dim * residual_bytes
    if cfg.crop_shadow:
        per_head += 2 * min(cfg.value_shadow, tv) * head_dim * residual_bytes
        per_head += G * staged_per_token if tk and tokens < tk + R + S else 0
    return per_head * layers * batch * kv_heads


def bf16_kv_bytes(tokens: int, layers: int, batch: int, kv_heads: int, head_dim: int) -> int:
    return 2 * tokens * head_dim * 2 * layers * batch * kv_heads


def model_kv_shape(model) -> dict:
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return {"layers": config.num_hidden_layers, "kv_heads": kv_heads, "head_dim": head_dim}
