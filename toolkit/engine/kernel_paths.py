"""Which code runs each kind of a model's work on this CPU, and at which ISA level (`toolkit.cpu`): what `specquant
bench` and `specquant diagnose` record beside their figures, so a figure says which kernels made it
(docs/kernels.md)."""

from __future__ import annotations

import torch

from toolkit import cpu
from toolkit.engine.lean_forward import LeanForward
from toolkit.engine.precision import HalfStorageLinear
from toolkit.quant.qlinear import QuantLinear


def _linear(module) -> str:
    """The kernel a Linear-like module's products run on when the native stack does not."""

    if isinstance(module, QuantLinear):
        return f"{module.bits}-bit {module.kernel}"
    if type(module) is HalfStorageLinear:
        if getattr(module, "fbgemm_fp16", None) is not None:
            return "fp16 x fp32 (fbgemm, few rows); wide path beyond"
        return f"{str(module.weight.dtype).removeprefix('torch.')} weights, torch"
    if isinstance(module, torch.nn.Linear):
        return f"{str(module.weight.dtype).removeprefix('torch.')} torch F.linear"
    return type(module).__name__


def kernel_paths(model) -> dict:
    """{isa, decoder, products: {kernel: count}, head[, why_not_native]} for an engine-prepared model."""

    out = {"isa": cpu.isa()}
    forward = model.__dict__.get("forward")
    native = forward.native_decoder() if isinstance(forward, LeanForward) else None
    if native is not None:
        out.update(native.describe())
        if out["head"] is None:
            out["head"] = _linear(model.get_output_embeddings())
        return out
    out["decoder"] = "lean forward (torch operators)" if isinstance(forward, LeanForward) else "transformers forward"
    if isinstance(forward, LeanForward):
        out["why_not_native"] = forward.native_reason
    products: dict[str, int] = {}
    head = model.get_output_embeddings()
    for module in model.modules():
        if module is not head and (isinstance(module, torch.nn.Linear) or hasattr(module, "bits")):
            name = _linear(module)
            products[name] = products.get(name, 0) + 1
    out["products"] = products
    out["head"] = _linear(head)
    return out


def summary(paths: dict) -> str:
    """One line of `kernel_paths`' record, for a terminal report."""
    products = ", ".join(f"{name} x{count}" for name, count in paths["products"].items())
    why = f" ({paths['why_not_native']})" if paths.get("why_not_native") else ""
    return f"kernels at ISA {paths['isa']}: {paths['decoder']}{why}; {products}; head: {paths['head']}"
