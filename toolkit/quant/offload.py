"""Calibrating a model larger than RAM: load it through accelerate with a memory cap (``device_map="auto"``,
``max_memory={"cpu": ...}``, ``offload_folder``), so the blocks that do not fit stay on disk with their weights on
the ``meta`` device, and bring ONE block at a time into RAM while the block driver quantizes it.

accelerate puts an ``AlignDevicesHook`` on every leaf module; an offloaded one has ``offload=True`` and a
``weights_map`` that reads its tensors from the offload folder. `onload` turns such modules into plain modules
holding real tensors (the hooks are removed: the driver writes fake-quant weights into them), and `release`
drops a finished block's quantized Linear weights back to ``meta`` so RAM stays about one block.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from toolkit.models import load_tokenizer, resolve
from toolkit.models.load import LoadedModel


def is_offloaded(module: nn.Module) -> bool:
    """True when accelerate keeps this module's own tensors off-RAM (on disk) and loads them per forward."""
    hook = getattr(module, "_hf_hook", None)
    return bool(getattr(hook, "offload", False)) and getattr(hook, "weights_map", None) is not None


def has_offloaded(model: nn.Module) -> bool:
    return any(is_offloaded(m) for m in model.modules())


@torch.no_grad()
def onload(root: nn.Module) -> None:
    """Give every offloaded module under ``root`` its real tensors (from the offload folder) and remove all
    accelerate hooks under ``root``, so it runs and can be modified as a plain in-RAM module."""
    from accelerate.hooks import remove_hook_from_module
    from accelerate.utils import set_module_tensor_to_device

    for module in root.modules():
        if not is_offloaded(module):
            continue
        weights_map = module._hf_hook.weights_map
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if tensor.device.type == "meta" and name in weights_map:
                set_module_tensor_to_device(module, name, "cpu", value=weights_map[name])
    remove_hook_from_module(root, recurse=True)


def release(linears: list[nn.Linear]) -> None:
    """Drop the Linears' weights to ``meta`` (shape kept): their `QuantizedWeight` is what the checkpoint saves."""
    for linear in linears:
        linear.weight = nn.Parameter(torch.empty_like(linear.weight, device="meta"), requires_grad=False)


def load_offloaded(name_or_path: str | Path, offload_folder: str | Path, max_memory: str | int | None):
    """`toolkit.models.load_model`'s result, but loaded by accelerate with at most ``max_memory`` of weights in
    RAM (``"2GiB"``, bytes, or None: accelerate's own estimate) and the rest offloaded to ``offload_folder``."""
    import time

    from transformers import AutoModelForCausalLM

    resolved = resolve(name_or_path)
    source = str(resolved.path) if resolved.path is not None else resolved.hub_id
    folder = Path(offload_folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    kwargs = {"max_memory": {"cpu": max_memory}} if max_memory is not None else {}
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, device_map="auto",
                                                 offload_folder=str(folder), **kwargs).eval()
    tokenizer = load_tokenizer(name_or_path)
    return LoadedModel(model, tokenizer, resolved.name, resolved.spec, resolved.path, torch.float32,
                       time.perf_counter() - start)
