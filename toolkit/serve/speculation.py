"""Speculative decoding in the server: which drafts it serves, and one row's share of a batched verify pass.

Only prompt lookup (spec=lookup) is served: it needs no model and no state, so a sequence joining, leaving or being
preempted changes nothing for the others. spec=self / spec=draft keep a draft KV cache per batch row
(toolkit.spec.drafts.ModelDraft over a RaggedBatch), which does not follow rows in and out of a continuous batch.

A verify pass is one model call over the running batch with the same q = n + 1 new tokens per row (n: the longest
draft this turn): each row's last token, its draft, and padding up to n. Each row is verified on its own drafted
tokens only (toolkit.spec.verify, greedy or rejection sampling, unchanged): its padded positions are computed and
thrown away, and `crop_sequence` drops their keys/values with the rejected ones. Verifying the padding as if it were
drafted would also be exact (a deterministic draft is q one-hot, whatever token it proposes), but junk tokens almost
never match, and the rows' random streams would then depend on the other rows' draft lengths.

Batched small-M matmuls are compute-bound on CPU: a verify pass of q tokens per row costs about q decode steps once
the batch is more than a few rows. So speculation runs only while the running batch has at most `max_batch` rows;
above it, the turn is a plain one-token decode step.
"""

from dataclasses import dataclass

import torch

from toolkit.errors import InputError
from toolkit.spec.build import draft_length, lookup_draft, spec_kind
from toolkit.spec.decode import DraftLength
from toolkit.spec.drafts import LookupDraft
from toolkit.spec.verify import verify

SERVED_KINDS = ("none", "lookup")


@dataclass(frozen=True)
class ServeSpec:
    draft: LookupDraft
    length: DraftLength  # tokens drafted per round: fixed k, or adaptive per sequence within [k_min, k_max]
    max_batch: int = 4  # speculate only while the running batch has at most this many rows

    @property
    def max_draft(self) -> int:
        return self.length.k_max if self.length.adaptive else self.length.k


def serve_spec(spec_cfg, max_batch: int = 4) -> ServeSpec | None:
    """The server's speculation for a `spec` config group node (or kind name); None for spec=none."""
    kind = spec_kind(spec_cfg)
    if kind == "none":
        return None
    if kind not in SERVED_KINDS:
        raise InputError(f"spec={kind} is not supported by the server (its draft keeps a KV cache per batch row, "
                         f"which does not follow sequences in and out of a continuous batch)",
                         f"use spec= one of {', '.join(SERVED_KINDS)} with specquant serve, or spec={kind} with "
                         f"specquant generate")
    if max_batch < 1:
        raise InputError(f"spec_max_batch must be >= 1, got {max_batch}", "set spec_max_batch= to a positive number "
                                                                          "(or spec=none)")
    return ServeSpec(lookup_draft(spec_cfg), draft_length(spec_cfg), max_batch)


def check_kv(spec: ServeSpec | None, residual_tokens: int | None) -> None:
    """A quantized KV pool seals a block once its sequence is `residual` tokens past it; a rejected draft is rolled
    back by cropping, which cannot reach into a sealed block. A verify pass adds k + 1 tokens and keeps at least 1."""
    if spec is None or residual_tokens is None or residual_tokens >= spec.max_draft:
        return
    raise InputError(f"kv.residual={residual_tokens} is below the draft length {spec.max_draft}: a rejected draft "
                     f"could not be rolled back out of the quantized KV blocks",
                     f"use kv.residual>={spec.max_draft}, or a smaller spec.k")


@dataclass
class RowVerdict:
    tokens: list[int]  # what the row emits this round: its kept draft prefix, then the target's next token
    proposed: int
    accepted: int


def verify_row(logits: torch.Tensor, drafted: list[int], sampling, generator) -> RowVerdict:
    """One row of a verify pass: `logits` [q, vocab] over its last token, its draft, then padding (ignored)."""
    n = len(drafted)
    verdict = verify(logits[:n + 1], drafted, None, sampling, generator)
    return RowVerdict(verdict.tokens(drafted), n, verdict.accepted)
