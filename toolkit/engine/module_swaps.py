"""A counter of module swaps: bumped whenever any module anywhere gets a submodule or parameter assigned (torch's
global registration hooks), and when the lean forward's fused packs are made or dropped. A LeanForward's cached
layer plan is rebuilt when it changed, so a module swapped after `install` (a quantized layer, a self-draft's copy)
is always the one that runs."""

from __future__ import annotations

import torch

GENERATION = [0]


def bump(*_) -> None:
    GENERATION[0] += 1


torch.nn.modules.module.register_module_module_registration_hook(bump)
torch.nn.modules.module.register_module_parameter_registration_hook(bump)
