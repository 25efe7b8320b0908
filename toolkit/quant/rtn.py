"""Round-to-nearest (RTN): each weight goes to the nearest point of its group's min/max grid. No calibration data.

The baseline the other algorithms (GPTQ, AWQ) are measured against: they choose codes on the same grid
(`toolkit.quant.primitives`), so only the choice of codes differs.
"""

from __future__ import annotations

import torch

from toolkit.quant.primitives import (
    QuantConfig,
    choose_qparams,
    quantize,
    search_qparams,
)
from toolkit.quant.quantized_weight import QuantizedWeight


def rtn_quantize(weight: torch.Tensor, config: QuantConfig, bias: torch.Tensor | None = None,
                 mse: bool = False) -> QuantizedWeight:
    """Quantize ``weight [out, in]`` to ``config``'s grid by rounding to nearest; ``bias`` is kept as is (copied).

    Exactly ``quantize(weight, *choose_qparams(weight, config), config)``. Every weight is within half a step
    (``scale / 2`` of its group, up to float32 rounding) of its dequantized value: the grid always covers the
    group's range, and the values that clip at its ends lie within half a step of the end point.
    With ``mse`` each group's range comes from `search_qparams` (shrunk where that rounds with less error), so
    the bound no longer holds for the clipped weights.
    """
    weight = weight.detach()
    scale, zero = (search_qparams if mse else choose_qparams)(weight, config)
    codes = quantize(weight, scale, zero, config)
    return QuantizedWeight(codes=codes, scale=scale, zero=zero, config=config,
                           bias=None if bias is None else bias.detach().clone())
