"""Section 4, KV pressure: bytes the KV cache holds per token and per sequence at the workload's context, and how
many sequences of that length fit a memory budget with an fp, INT8 or INT4 cache (the exact bytes formula of
toolkit.kv.memory, residual window and scales included, so short contexts show the real, smaller saving)."""

import torch

from toolkit.engine.costs import kv_bytes_per_token
from toolkit.kv import KVSpec
from toolkit.kv.memory import model_kv_shape, quantized_kv_bytes

KINDS = ("fp", "int8", "int4")


def sequence_kv_bytes(model, kind: str, tokens: int, activation_dtype: torch.dtype, kv: KVSpec | None = None) -> int:
    """Bytes one sequence of `tokens` holds in a cache of `kind` (`kv`: that kind's KVSpec, else its defaults)."""
    if kind == "fp":
        return kv_bytes_per_token(model, activation_dtype) * tokens
    cfg = (kv if kv is not None else KVSpec(kind)).quant
    return quantized_kv_bytes(cfg, tokens, batch=1, residual_bytes=torch.tensor([], dtype=activation_dtype)
                              .element_size(), **model_kv_shape(model))


def kv_pressure(model, context_tokens: int, activation_dtype: torch.dtype, budget_bytes: int,
                kv_nodes: dict[str, KVSpec] | None = None) -> dict:
    """`context_tokens`: prompt + new tokens of the longest request; `budget_bytes`: memory left for KV caches;
    `kv_nodes`: a KVSpec per kind whose options differ from the defaults."""
    kv_nodes = kv_nodes or {}
    rows = {}
    for kind in KINDS:
        per_seq = sequence_kv_bytes(model, kind, context_tokens, activation_dtype, kv_nodes.get(kind))
        rows[kind] = {"bytes_per_token": per_seq / context_tokens, "bytes_per_sequence": per_seq,
                      "sequences_in_budget": int(budget_bytes // per_seq) if per_seq else 0}
    return {"context_tokens": context_tokens, "activation_dtype": str(activation_dtype).removeprefix("torch."),
            "budget_bytes": int(budget_bytes), "kinds": rows}


def default_budget(weight_bytes: int) -> int:
    """The memory a server could give KV caches here: what is available now, less one more copy of the weights."""
    import psutil

    return max(0, psutil.virtual_memory().available - weight_bytes)
