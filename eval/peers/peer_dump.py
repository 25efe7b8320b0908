"""The dump a peer script writes (layout: benchmarks/quant_peers.py): codes, scales, zeros per quantized Linear,
the float rest, and a JSON record. Imports nothing of specquant's: it runs in the peers' venv."""

import importlib.metadata
import json
import resource

import torch
from safetensors.torch import save_file


def versions(*packages: str) -> dict:
    return {name: importlib.metadata.version(name) for name in packages}


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def write_dump(path: str, model: torch.nn.Module, layers: dict, record: dict) -> None:
    """``layers``: name -> (codes [out, in] int, scale [out, groups] float, zero [out, groups] int), unsigned codes
    with ``(codes - zero) * scale`` the peer's dequantized weight. Every other state-dict tensor is saved as float."""
    tensors = {}
    for name, (codes, scale, zero) in layers.items():
        bits = record["bits"]
        if codes.min() < 0 or codes.max() >= 2**bits or zero.min() < 0 or zero.max() >= 2**bits:
            raise ValueError(f"{name}: codes or zeros outside 0..{2**bits - 1}")
        tensors[f"{name}.codes"] = codes.to(torch.uint8).contiguous()
        tensors[f"{name}.scale"] = scale.float().contiguous()
        tensors[f"{name}.zero"] = zero.to(torch.uint8).contiguous()
    quantized = {f"{name}.weight" for name in layers}
    seen = set()
    for key, value in model.state_dict().items():
        if key in quantized or key.rsplit(".", 1)[-1] not in ("weight", "bias"):  # the tools' qparam buffers
            continue
        ident = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        if ident in seen:  # tied embeddings: once
            continue
        seen.add(ident)
        tensors[f"float.{key}"] = value.detach().float().contiguous().clone()
    record = {**record, "layers": sorted(layers)}
    save_file(tensors, path, metadata={"peer": json.dumps(record)})
