"""A draft's own quantized output head (`spec.head_bits`): the head is the largest single read of a small model's
decode step (SmolLM2-135M: 49152 x 576, 28M of its 135M weights; Qwen2.5-Coder-0.5B: 151936 x 896, 136M of 494M),
and quantized checkpoints keep it in float (toolkit/quant/model_quant.py never quantizes it, for quality). A draft
only proposes tokens, which the target verifies, so a coarser head costs acceptance, never correctness.

The head is RTN-quantized on load into a QuantLinear (specquant's int4 or int8 GEMM where they build) and set on
the draft alone: a self-draft is a shallow copy of the target with its own module table, so the target keeps its
float head; a tied embedding stays float (only the head's product is replaced).
"""

from __future__ import annotations

import torch

from toolkit.errors import InputError
from toolkit.quant import vnni
from toolkit.quant.primitives import QuantConfig
from toolkit.quant.qlinear import QuantLinear
from toolkit.quant.rtn import rtn_quantize
from toolkit.spec.draft_vocab import SubsetHead

HEAD_BITS = (4, 8)


def quantize_draft_head(model, bits: int, group_size: int, act_bits: int | None = None,
                        vocab: torch.Tensor | None = None) -> None:
    """Replace `model`'s output head with an RTN `bits`-bit QuantLinear (asymmetric, `group_size` columns a group for
    4 bits; 8 bits are symmetric per channel, the layout the int8 GEMM runs). With `act_bits=8` a `VnniLinear`
    instead (int8 activations in groups of `group_size`, AVX512-VNNI) where the CPU and the shape allow it.

    `vocab` (sorted token ids, `toolkit.spec.draft_vocab`): the quantized head keeps only those rows, inside a
    `SubsetHead` that also scores the context's other tokens from the float weight; its `vocab_ids` map the
    logits' columns back to tokens."""

    if bits not in HEAD_BITS:
        raise InputError(f"spec.head_bits must be one of {HEAD_BITS} or null, got {bits}", "use spec.head_bits=4")
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is None or weight.dim() != 2:
        raise InputError(f"the draft's output head ({type(head).__name__}) has no float weight to quantize",
                         "leave spec.head_bits=null")
    source = weight.detach()
    if vocab is not None:
        weight = weight[vocab]
    in_features = weight.shape[1]
    if bits == 4 and in_features % group_size:
        raise InputError(f"spec.head_group_size {group_size} does not divide the head's input width {in_features}",
                         "pick one that does (SmolLM2: 64; Qwen2.5: 128)")
    config = (QuantConfig(bits=4, group_size=group_size, symmetric=False) if bits == 4
              else QuantConfig(bits=8, group_size=-1, symmetric=True))
    bias = full_bias = getattr(head, "bias", None)
    if bias is not None and vocab is not None:
        bias = bias[vocab]
    qw = rtn_quantize(weight.detach().float(), config, None if bias is None else bias.detach().float())
    head = None
    if act_bits == 8 and weight.device.type == "cpu":

        if vnni.available(bits) and vnni.supports(weight.shape[0], in_features, group_size):
            head = vnni.VnniLinear.from_quantized(qw, act_group=group_size)
    if head is None:
        head = QuantLinear.from_quantized(qw, weight.device)
    if vocab is not None:

        head = SubsetHead(head, vocab, source, None if bias is None else full_bias.detach())
    model.lm_head = head
