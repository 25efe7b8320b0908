"""Attention over a paged batch whose rows have different lengths, without padding every row to the longest.

A batched model call over the paged cache reads each layer's keys/values through the block tables, one row per
sequence, every row as wide as the longest (shorter rows are masked). In a serving batch the lengths spread widely
(prompts of 128 to 512 tokens, each at its own point of decoding), so a third or more of what is gathered and run
through attention is padding; and torch's CPU flash kernel slows down more than linearly past 512 keys. Measured on
SmolLM2-135M INT4, 16 rows of 170-671 tokens: one decode step 174 ms, of which attention 59 ms and the gather 28 ms.

So rows are sorted by width and cut into a few buckets (`bucket_rows`): each bucket gathers only up to its own
widest row and runs attention on its own; the outputs are put back in row order. Each bucket costs a few more op
calls per layer, so a cut is made only where the padding it saves outweighs that (`BUCKET_OVERHEAD_TOKENS`).

How it plugs into transformers: the model's attention implementation becomes `PAGED_ATTENTION` (registered below;
`use_paged_attention(model)`), which is exactly sdpa unless the paged cache hands it a plan. The cache's `update`
writes the new keys/values and, instead of gathering, puts the plan into the `kwargs` dict that Llama, Qwen2 and
Gemma 3 pass both to `cache.update(..., kwargs=kwargs)` and to the attention function that follows. A model that did
not pass that dict would get the plain padded gather (the cache checks for it), never a wrong answer.
"""

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
)

PAGED_ATTENTION = "specquant_paged_sdpa"
PLAN_KEY = "specquant_paged_plan"  # the kwargs entry carrying the plan from cache.update to the attention call
# The fixed cost of one more bucket (an index_select, an sdpa call and a copy back per layer, ~50 us), in gathered
# tokens of SmolLM2-135M's keys/values (~0.27 us each per layer, gather plus attention).
BUCKET_OVERHEAD_TOKENS = 192


@dataclass
class Bucket:
    rows: torch.Tensor  # batch rows in this bucket (long)
    index: torch.Tensor  # [n, width] slots to gather (columns a row does not see read slot 0, masked)
    masks: dict  # layer type -> mask [n, 1, q, width] as the model's attention takes it


@dataclass
class LayerPlan:
    """What the attention call of one layer needs: where the keys/values live and how the batch is cut."""

    storage: object  # the paged storage (gather(layer, index))
    layer: int
    layer_type: str  # "full_attention" or "sliding_attention": which of each bucket's masks applies
    buckets: list[Bucket]


def bucket_rows(widths: list[int], overhead: int = BUCKET_OVERHEAD_TOKENS) -> list[list[int]]:
    """Cut rows (indices into `widths`) into buckets of consecutive widths, minimising gathered tokens (each
    bucket's rows times its widest row) plus `overhead` per bucket. Exact, by dynamic programming over the sorted
    widths (O(rows^2); rows are at most a server's batch)."""
    order = sorted(range(len(widths)), key=widths.__getitem__)
    sorted_w = [widths[i] for i in order]
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j sorted rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # last bucket = sorted rows i..j-1, as wide as row j-1
            cost = best[i] + (j - i) * sorted_w[j - 1] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    buckets, j = [], n
    while j > 0:
        buckets.append(order[cut[j]:j])
        j = cut[j]
    return buckets[::-1]


def paged_sdpa(module, query, key, value, attention_mask, **kwargs):
    """sdpa, or with a paged plan, sdpa bucket by bucket over keys/values gathered bucket by bucket."""
    plan: LayerPlan | None = kwargs.pop(PLAN_KEY, None)
    if plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = None
    for bucket in plan.buckets:
        keys, values = plan.storage.gather(plan.layer, bucket.index)
        part, _ = sdpa_attention_forward(module, query.index_select(0, bucket.rows), keys, values,
                                         bucket.masks[plan.layer_type], **kwargs)
        if out is None:  # [rows, q, heads, dim], as sdpa_attention_forward returns
            out = part.new_empty((query.shape[0], *part.shape[1:]))
        out.index_copy_(0, bucket.rows, part)
    return out, None


AttentionInterface.register(PAGED_ATTENTION, paged_sdpa)
if PAGED_ATTENTION not in ALL_MASK_ATTENTION_FUNCTIONS:  # masks built by transformers (outside the paged cache)
    AttentionMaskInterface.register(PAGED_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def use_paged_attention(model):
    """Switch a model on sdpa to `PAGED_ATTENTION` (the same arithmetic wherever no paged plan is given); a model on
    another implementation is left as it is, and the paged cache then pads every row to the longest."""
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(PAGED_ATTENTION)
    return model
