"""The bytes a decode step reads: every weight once, and the KV cache's keys and values at the context it attends
to. Their sum over the measured bandwidth is the decode floor that bench and the doctor compare a step against."""

import torch

from toolkit.quant.qlinear import weight_bytes


def weight_bytes_per_token(model) -> int:
    """Bytes of weights a decode step reads: every parameter and quantized layer once, except the input embedding
    table, of which a step reads one row (when it is tied to the output head, the head reads it in full, counted
    once)."""

    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and getattr(output, "weight", None) is embedding
    return weight_bytes(model) - (0 if tied else embedding.numel() * embedding.element_size())


def kv_bytes_per_token(model, dtype: torch.dtype) -> int:
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
