"""The hand-off between quantization algorithms and the runtime: one Linear layer's weight as integer codes on a
group-wise grid. Algorithms (RTN, GPTQ, AWQ) produce these; checkpoints store them; QuantLinear packs them for a
kernel at load time (packed kernel layouts depend on the CPU, so they are never what is saved)."""

from dataclasses import dataclass

import torch

from toolkit.quant.primitives import QuantConfig, dequantize


@dataclass
class QuantizedWeight:
    codes: torch.Tensor  # uint8 [out, in], values in [0, 2**bits - 1]
    scale: torch.Tensor  # float32 [out, n_groups]
    zero: torch.Tensor  # int32 [out, n_groups], the code that stands for 0.0
    config: QuantConfig
    bias: torch.Tensor | None = None  # float, [out]
    # act-order (GPTQ desc_act): the group of each input channel; None means channel // group_size
    g_idx: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    def group_index(self) -> torch.Tensor:
        """The group of each input channel, [in] int64."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features) // self.config.resolve_group_size(self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out, in] these codes stand for."""
        if self.g_idx is None:
            return dequantize(self.codes, self.scale, self.zero, self.config, dtype)
        groups = self.group_index()
        return ((self.codes.float() - self.zero[:, groups].float()) * self.scale[:, groups]).to(dtype)
