"""Weight quantization. `primitives` holds the pure numeric pieces (qparams, quantize/dequantize, packing
formats); algorithms (RTN, GPTQ, AWQ) and checkpoint export build on them."""

from toolkit.quant.primitives import (
    QuantConfig,
    choose_qparams,
    dequantize,
    gptq_g_idx,
    gptq_scales,
    pack_gptq,
    pack_int4_rows,
    quantize,
    unpack_gptq,
    unpack_int4_rows,
)

__all__ = [
    "QuantConfig",
    "choose_qparams",
    "dequantize",
    "gptq_g_idx",
    "gptq_scales",
    "pack_gptq",
    "pack_int4_rows",
    "quantize",
    "unpack_gptq",
    "unpack_int4_rows",
]
