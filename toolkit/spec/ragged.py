"""A batch of sequences that advance by different numbers of tokens over one shared KV cache.

Speculative decoding keeps a different number of tokens per sequence each round. Instead of per-row cache lengths
(which every cache kind would have to support), every row writes the same slots and a per-row slot mask marks which
slots hold real tokens: a rejected draft token's slot is masked out for its row, for good, and attention never sees
it again. Positions come from the mask (count of real tokens so far), exactly as the engine derives them, so a row
sees the same positions and the same keys as it would alone. The cache itself is only ever cropped (`crop`), which
every cache kind honours.

With one sequence no slot is ever masked (what it keeps is always a prefix), and the mask is not passed at all:
attention takes its plain causal path, as in the engine's own decode.

Sliding-window layers (Gemma 3) count the window in slots, so holes in a batch shrink their window: batches of
sliding-window models are not token-identical to running each sequence alone (one sequence is).
"""


import torch

from toolkit.engine.generate import takes_logits_to_keep
from toolkit.engine.lean_forward import one_token_forward
from toolkit.engine.precision import exact_linears, overflowed


class RaggedBatch:
    """`model`'s view of `batch` sequences over `cache`. `mark` starts a round; `feed` runs new tokens (any number of
    times); `keep` keeps, per row, a prefix of what was fed since the mark and rolls back the rest."""

    def __init__(self, model, cache, batch: int, pad_id: int, forward=None):
        self.model, self.cache, self.pad_id = model, cache, pad_id
        self.forward = forward or model
        device = next(model.parameters()).device
        self.mask = torch.zeros(batch, 0, dtype=torch.long, device=device)  # [batch, cache slots]; batch 1: unused
        self._counts = torch.zeros(batch, dtype=torch.long, device=device)  # real tokens per row (batch > 1)
        self._count = 0  # one sequence's: a Python int, read and bumped at every drafted token without a tensor op
        self._start = 0  # cache length at the mark
        self._written: list[list[int]] = [[] for _ in range(batch)]  # per row: slots of the tokens fed since the mark

    @property
    def batch(self) -> int:
        return self.mask.shape[0]

    @property
    def counts(self) -> torch.Tensor:
        """Real tokens per row [batch] (a copy)."""
        return torch.tensor([self._count], device=self.mask.device) if self.batch == 1 else self._counts.clone()

    def mark(self) -> None:
        self._start = self.cache.length
        self._written = [[] for _ in range(self.batch)]

    def feed(self, rows: list[list[int]], logits: int | None = None) -> torch.Tensor:
        """Run row i's tokens `rows[i]` (lengths may differ; at least one each) after its cached ones. Returns logits
        [batch, width, vocab] for the last `logits` columns (None: all `width`, the longest row); rows are aligned
        on the right, so row i's tokens are its last len(rows[i]) columns."""
        if self.batch == 1:
            return self._feed_one(rows[0], logits)
        lengths = [len(r) for r in rows]
        width = max(lengths)
        device = self.mask.device
        ids = torch.full((self.batch, width), self.pad_id, dtype=torch.long)
        new_mask = torch.zeros(self.batch, width, dtype=torch.long)
        for i, r in enumerate(rows):
            if r:
                ids[i, width - len(r):] = torch.tensor(r)
                new_mask[i, width - len(r):] = 1
        ids, new_mask = ids.to(device), new_mask.to(device)
        positions = (self._counts[:, None] + new_mask.cumsum(-1) - 1).masked_fill(new_mask == 0, 1)
        mask = torch.cat([self.mask, new_mask], dim=1)
        start = self.cache.length
        out = self._run(ids, None if bool(mask.all()) else mask, positions, logits or width, start)
        self.mask = mask
        self._counts = self._counts + new_mask.sum(-1)
        for i, n in enumerate(lengths):
            self._written[i].extend(range(start + width - n, start + width))
        return out

    def _feed_one(self, row: list[int], logits: int | None) -> torch.Tensor:
        """`feed` for one sequence: every slot holds a real token (what it keeps is always a prefix), so no mask is
        built or passed and positions run on from its count -- the same ids and positions `feed` makes, without the
        ~0.1-0.2 ms of tensor bookkeeping per call that a draft pays at every drafted token."""
        n = len(row)
        device = self.mask.device
        start, count = self.cache.length, self._count
        if n == 1:  # a drafted token's step: the lean forward's one-token path where the native stack runs it
            out = self._one_token(row[0], count)
            if out is not None:
                self._count += 1
                self._written[0].append(start)
                return out
        ids = torch.tensor([row], dtype=torch.long, device=device)
        positions = torch.arange(count, count + n, device=device)[None]
        out = self._run(ids, None, positions, logits or n, start)
        self._count += n
        self._written[0].extend(range(start, start + n))
        return out

    def _one_token(self, token: int, position: int) -> torch.Tensor | None:
        """`_run` of one token through `LeanForward.one_token` (the same arithmetic), or None where that does not
        apply (the caller runs it the general way)."""
        lean = one_token_forward(self.model) if self.forward is self.model else None
        if lean is None:
            return None
        # no overflow check (`_run`'s): the native stack holds activations in fp32 and sums every product in fp32
        # (fp16 or bf16 weights, bf16 activations at most), so no fp16 overflow can come out of it
        with torch.inference_mode():
            return lean.one_token(token, position, self.cache)

    def _run(self, ids, mask, positions, keep, start) -> torch.Tensor:
        takes_keep = takes_logits_to_keep(type(self.model))
        # where the cache asks for a pass in pieces (a flush inside a verify pass on a quantized cache) and the
        # forward cannot do it inside attention, each piece is a forward of its own: the same readings, more passes
        lean = self.model.__dict__.get("forward")
        lean = lean if getattr(lean, "takes_read_splits", lambda: False)() else None
        splits = [] if lean is not None else getattr(self.cache, "read_splits", lambda n: [])(ids.shape[1])
        edges = [0, *splits, ids.shape[1]]
        # the lean forward's logits called directly (what its __call__ would run for these arguments), without the
        # module call and the output object around them: a draft pays those at every drafted token
        direct = lean.logits if lean is not None and self.forward is self.model else None

        def run():
            outs = []
            for a, b in zip(edges, edges[1:]):
                n = keep if len(edges) == 2 else b - a
                part_mask = None if mask is None else mask[:, :start + b]
                if direct is not None:
                    out = direct(ids[:, a:b], part_mask, positions[:, a:b], self.cache, n)
                else:
                    out = self.forward(input_ids=ids[:, a:b], attention_mask=part_mask, position_ids=positions[:, a:b],
                                       cache=self.cache, use_cache=True,
                                       **({"logits_to_keep": n} if takes_keep else {})).logits
                outs.append(out[:, -n:])
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)[:, -keep:]

        with torch.inference_mode():
            out = run()
            if overflowed(self.model, out):
                self.cache.crop(start)  # the overflowed pass wrote garbage: drop it and redo it exactly (as the engine)
                with exact_linears():
                    out = run()
        return out

    def reset_to(self, length: int) -> None:
        """One sequence whose cache was filled to `length` slots from elsewhere (a shared draft cache): every slot a
        real token, the round marked there."""
        if self.batch != 1 or self.cache.length != length:
            raise ValueError(f"reset_to({length}) needs one sequence and a cache of that length")
        self._count = length  # (one sequence keeps no mask: `_feed_one`)
        self.mark()

    def keep(self, kept: list[int]) -> None:
        """Of the tokens fed to row i since the mark, keep its first kept[i]; roll the rest back (mask them out for
        the row, and crop the cache after the last slot any row keeps)."""
        if self.batch == 1:  # a kept prefix: nothing to mask (`_feed_one` keeps no mask), the cache cropped after it
            slots, k = self._written[0], kept[0]
            if not 0 <= k <= len(slots):
                raise ValueError(f"row 0: cannot keep {k} of {len(slots)} fed tokens")
            self._count -= len(slots) - k
            self.cache.crop(slots[k - 1] + 1 if k else self._start)
            self.mark()
            return
        ends = [self._start]
        for i, (slots, k) in enumerate(zip(self._written, kept)):
            if not 0 <= k <= len(slots):
                raise ValueError(f"row {i}: cannot keep {k} of {len(slots)} fed tokens")
            for slot in slots[k:]:
                self.mask[i, slot] = 0
            self._counts[i] -= len(slots) - k
            if k:
                ends.append(slots[k - 1] + 1)
        end = max(ends)
        self.cache.crop(end)
        self.mask = self.mask[:, :end]
        self.mark()
