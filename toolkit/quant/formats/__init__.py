"""Export our quantized checkpoints to the formats other tools load, and import those formats back.

Two formats, one module each:

* ``gptq`` (`gptq_v1`): the GPTQ "v1" checkpoint format auto-gptq defined and transformers (through optimum and
  gptqmodel), vLLM and gptqmodel load. Takes 2/3/4/8-bit codes, any group size (-1 included), symmetric or
  asymmetric, act-order (its ``g_idx`` is stored as is). Cannot take an asymmetric group whose zero point is 0:
  v1 stores ``zero - 1``, which wraps (see `toolkit.quant.primitives.pack_gptq`).
* ``awq`` (`awq_gemm`): AutoAWQ's GEMM format. Takes 4-bit codes with groups (group_size > 0) and no act-order;
  symmetric weights are stored as asymmetric ones whose zero points are all 8 (exact).

Everything else raises `ExportError` naming what does not fit and which format would. A foreign directory is
recognised by ``quantization_config.quant_method`` in its ``config.json`` (`detect_format`) and imported into a
`QuantizedStateDict` + float model (`import_checkpoint`), which the engine runs through our ``QuantLinear``:
no gptqmodel needed.
"""

from toolkit.quant.formats.common import (
           EXPORT_MANIFEST,
           ExportError,
           detect_format,
           export_source,
)
from toolkit.quant.formats.convert import (
           FORMATS,
           export_checkpoint,
           import_checkpoint,
           is_foreign_quantized,
           is_quantized_model,
)

__all__ = ["EXPORT_MANIFEST", "FORMATS", "ExportError", "detect_format", "export_checkpoint", "export_source",
           "import_checkpoint", "is_foreign_quantized", "is_quantized_model"]
