"""A paged KV cache (PagedAttention-style) with prefix caching, as a transformers `Cache`.

Memory is a pool of fixed-size blocks (`BlockPool` keeps the books, a storage object holds the tensors). Each
sequence (`PagedSequence`) has a block table; blocks are taken as it grows and given back when it ends, is cancelled
or is cropped. Full blocks are registered under their token prefix, so a later prompt that starts the same way
reuses them (reference counted) and prefills only the rest; a sequence about to write into a block it shares, or
into one registered under a key its new tokens would falsify, first copies it (copy-on-write).

One model call runs a batch of sequences, each with the same number q of new tokens (q = 1 for a decode step, the
suffix length for a prefill of one sequence, k + 1 for a speculative verify):

    positions, mask = cache.bind(seqs, new_tokens)   # allocate/COW the blocks the new tokens go to
    logits = model(input_ids=..., position_ids=positions, attention_mask=mask, cache=cache)
    cache.commit()                                   # lengths advance, newly full blocks are registered

Each attention layer writes its new keys/values to their slots and reads the batch through the block tables (one
gather per layer; `storage.py`). Sequences of different lengths decode together behind a per-row mask, as in the
slot cache, so a sequence joins or leaves a running batch at any step.
"""

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from toolkit.kv.config import compute_dtype
from toolkit.kv.paged.attention import (
    PAGED_ATTENTION,
    PLAN_KEY,
    Bucket,
    LayerPlan,
    bucket_rows,
)
from toolkit.kv.paged.pool import ROOT, BlockPool, OutOfBlocks
from toolkit.kv.paged.storage import FPBlockStorage


@dataclass
class PagedSequence:
    """One sequence's view of the pool: its block table and the tokens whose keys/values it holds."""

    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # token ids written, in order (len = length)
    key_ids: list[int] = field(default_factory=list)  # prefix key id after each registered full block
    cached_tokens: int = 0  # prompt tokens found in the prefix cache when it was admitted
    sealed: int = 0  # leading blocks the storage has sealed (quantized storages; see storage.py)

    @property
    def length(self) -> int:
        return len(self.tokens)


class PagedKVLayer(CacheLayerMixin):
    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, owner: "PagedKVCache", index: int):
        super().__init__()
        self.owner, self.index = owner, index
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # storage is allocated up front
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        owner = self.owner
        if key_states.shape[0] != len(owner.batch) or key_states.shape[2] != owner.q:
            raise RuntimeError(f"paged cache bound to {len(owner.batch)} rows x {owner.q} tokens, got "
                               f"{tuple(key_states.shape)}: call bind() before the model")
        owner.storage.write(self.index, owner.write_slots, key_states, value_states)
        passed = kwargs.get("kwargs")  # the dict the model hands on to its attention call (see attention.py)
        if owner.buckets is not None and isinstance(passed, dict):
            layer_type = owner.layer_types[self.index] if owner.layer_types else "full_attention"
            passed[PLAN_KEY] = LayerPlan(owner.storage, self.index, layer_type, owner.buckets)
            return key_states, value_states  # unused: the attention call gathers bucket by bucket
        self.keys, self.values = owner.storage.gather(self.index, owner.read_index)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width, 0

    def get_seq_length(self) -> int:
        return self.owner.width - self.owner.q if self.owner.batch else 0

    def get_max_length(self) -> int:
        return -1


class PagedKVCache(Cache):
    """Keys/values for any number of sequences in `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, model, num_blocks: int, block_size: int = 16, storage=None, prefix_cache: bool = True):
        config = model.config.get_text_config(decoder=True)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        param = next(model.parameters())
        self.dtype, self.device = _activation_dtype(model), param.device
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.prefix_cache = prefix_cache  # False: blocks are never registered, so nothing is reused or kept cached
        self.storage = storage or FPBlockStorage(config.num_hidden_layers, num_blocks, block_size, kv_heads,
                                                 head_dim, self.dtype, self.device)
        attach = getattr(self.storage, "attach", None)
        if attach is not None:  # a storage that reclaims its staging from idle blocks needs to see the pool
            attach(self.pool)
        super().__init__(layers=[PagedKVLayer(self, i) for i in range(config.num_hidden_layers)])
        self.layer_types = list(getattr(config, "layer_types", None) or [])
        self.sliding_window = getattr(config, "sliding_window", None)
        self.mask_is_bool = config._attn_implementation in ("sdpa", PAGED_ATTENTION, "flex_attention", None)
        if config._attn_implementation not in ("sdpa", PAGED_ATTENTION, "eager", None):
            raise NotImplementedError(f"paged cache masks for attention {config._attn_implementation!r}")
        # rows of different lengths are read bucket by bucket rather than all padded to the longest (attention.py)
        self.bucketed = config._attn_implementation == PAGED_ATTENTION
        self.buckets: list[Bucket] | None = None
        self.batch: list[PagedSequence] = []
        self.q = 0
        self.width = 0
        self._pending: list[list[int]] = []

    @classmethod
    def with_budget(cls, model, budget_bytes: int, block_size: int = 16, **kwargs) -> "PagedKVCache":
        """As many blocks as `budget_bytes` holds."""
        per_block = cls.bytes_per_block(model, block_size)
        if budget_bytes < per_block:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no {per_block}-byte block")
        return cls(model, budget_bytes // per_block, block_size, **kwargs)

    @staticmethod
    def bytes_per_block(model, block_size: int) -> int:
        config = model.config.get_text_config(decoder=True)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return FPBlockStorage.bytes_per_block(config.num_hidden_layers, block_size, kv_heads, head_dim,
                                              _activation_dtype(model))

    # --- sequences ------------------------------------------------------------------------------------------
    def new_sequence(self, prompt_ids: list[int], reuse_prefix: bool = True) -> PagedSequence:
        """A sequence holding the longest cached prefix of `prompt_ids` (whole blocks, leaving at least one token
        to run so the caller gets its logits); `prompt_ids[seq.length:]` is what remains to prefill."""
        seq = PagedSequence()
        if reuse_prefix and self.prefix_cache:
            blocks, parent = self.pool.match_prefix(prompt_ids, len(prompt_ids) - 1)
            seq.blocks = blocks
            seq.tokens = list(prompt_ids[:len(blocks) * self.block_size])
            seq.key_ids = [self.pool.key_id[b] for b in blocks]
            seq.cached_tokens = seq.length
            seq.sealed = sum(1 for b in blocks if self.storage.is_sealed(b))
            assert not blocks or seq.key_ids[-1] == parent
        return seq

    def free(self, seq: PagedSequence) -> None:
        """Give back every block of `seq` (it finished or was cancelled)."""
        for block in seq.blocks:
            self.pool.release(block)
        seq.blocks, seq.tokens, seq.key_ids, seq.sealed = [], [], [], 0

    def crop_sequence(self, seq: PagedSequence, length: int) -> None:
        """Roll `seq` back to its first `length` tokens; whole blocks past them go back to the pool."""
        if not 0 <= length <= seq.length:
            raise ValueError(f"cannot crop a sequence of {seq.length} tokens to {length}")
        bs = self.block_size
        sealed_end = seq.sealed * bs
        if length % bs and self.storage.is_sealed(seq.blocks[length // bs]):  # sealed by a sequence sharing it
            sealed_end = (length // bs + 1) * bs
        if length < sealed_end:
            raise ValueError(f"cannot crop to {length} tokens: the first {sealed_end} are sealed (quantized); a "
                             f"rollback may reach back at most the storage's residual_tokens")
        keep = self.pool.blocks_for(length)
        for block in seq.blocks[keep:]:
            self.pool.release(block)
        del seq.blocks[keep:]
        del seq.tokens[length:]
        del seq.key_ids[length // self.block_size:]

    def blocks_needed(self, seq: PagedSequence, new_tokens: int) -> int:
        """Blocks `bind` would take for `new_tokens` more tokens of `seq` (new ones and copy-on-write copies)."""
        bs, start = self.block_size, seq.length
        first, last = start // bs, (start + new_tokens - 1) // bs
        need = max(0, last + 1 - len(seq.blocks))
        if first < len(seq.blocks) and self.pool.ref_count[seq.blocks[first]] > 1:
            need += 1
        return need

    # --- one model call ---------------------------------------------------------------------------------------
    def bind(self, seqs: list[PagedSequence], new_tokens: list[list[int]]):
        """Prepare a model call over `seqs`, each adding the same number of tokens; returns (positions [rows, q],
        attention mask). Blocks for the new tokens are allocated (or copied on write) here; raises OutOfBlocks,
        with nothing changed for sequences already bound, if the pool runs dry."""
        q = len(new_tokens[0])
        if any(len(t) != q for t in new_tokens) or q == 0:
            raise ValueError("every sequence in one call adds the same, non-zero number of tokens")
        bs, device = self.block_size, self.device
        for i, seq in enumerate(seqs):
            try:
                self._make_writable(seq, seq.length, seq.length + q)
            except OutOfBlocks:  # give back what this bind took for the rows before (a copy-on-write copy stays)
                for done in seqs[:i + 1]:
                    self.crop_sequence(done, done.length)
                raise
        lengths = torch.tensor([s.length for s in seqs], device=device)
        self.width = int(lengths.max()) + q
        offsets = torch.arange(q, device=device)
        cols = torch.arange(self.width, device=device)
        table_width = -(-self.width // bs)
        tables = torch.zeros(len(seqs), table_width, dtype=torch.long, device=device)
        for r, seq in enumerate(seqs):
            tables[r, :len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.long)
        # slot of column c of row r: its block's first slot + offset in block; columns past a row's end read slot
        # 0 (block 0 may belong to anyone: those columns are masked)
        slots = tables[:, cols // bs] * bs + cols % bs
        positions = lengths[:, None] + offsets[None, :]  # [rows, q]
        self.write_slots = slots.gather(1, positions).reshape(-1)
        visible = cols[None, None, :] <= positions[:, :, None]  # [rows, q, width]
        self.read_index = torch.where(visible.any(1), slots, torch.zeros_like(slots))
        self.batch, self.q, self._pending = seqs, q, new_tokens
        self.buckets = self._buckets(lengths, visible, positions, cols) if self.bucketed and len(seqs) > 1 else None
        return positions, self._masks(visible, positions, cols)

    def _buckets(self, lengths, visible, positions, cols) -> list[Bucket] | None:
        """The batch cut into buckets of similar width (attention.bucket_rows); None when one bucket is best (the
        plain padded gather then runs)."""
        widths = (lengths + self.q).tolist()
        groups = bucket_rows(widths)
        if len(groups) == 1:
            return None
        buckets = []
        for group in groups:
            rows = torch.tensor(group, dtype=torch.long, device=self.device)
            width = max(widths[r] for r in group)
            buckets.append(Bucket(rows, self.read_index[rows, :width],
                                  self._mask_dict(visible[rows, :, :width], positions[rows], cols[:width])))
        return buckets

    def commit(self) -> None:
        """The bound call ran: the new tokens are now held; register the blocks they filled."""
        bs = self.block_size
        for seq, new in zip(self.batch, self._pending):
            seq.tokens.extend(int(t) for t in new)
            for j in range(len(seq.key_ids), seq.length // bs if self.prefix_cache else 0):
                parent = seq.key_ids[-1] if seq.key_ids else ROOT
                seq.key_ids.append(self.pool.register(seq.blocks[j], parent, tuple(seq.tokens[j * bs:(j + 1) * bs])))
            residual = self.storage.residual_tokens
            if residual is not None:  # seal the full blocks that fell `residual` tokens behind the end
                for j in range(seq.sealed, max(0, seq.length - residual) // bs):
                    self.storage.seal_block(seq.blocks[j])
                seq.sealed = max(seq.sealed, max(0, seq.length - residual) // bs)
        self.batch, self._pending, self.buckets = [], [], None

    def _make_writable(self, seq: PagedSequence, start: int, end: int) -> None:
        bs, pool = self.block_size, self.pool
        first = start // bs
        if first < len(seq.blocks):
            block = seq.blocks[first]
            if pool.ref_count[block] > 1:  # shared: copy before writing (the others keep the original)
                fresh = self._allocate()
                self.storage.copy_block(block, fresh)
                pool.release(block)
                seq.blocks[first] = fresh
                pool.stats.cow_copies += 1
            else:  # ours alone, but its key says it holds tokens we are about to overwrite
                pool.unregister(block)
        while len(seq.blocks) * bs < end:
            seq.blocks.append(self._allocate())

    def _allocate(self) -> int:
        block = self.pool.allocate()
        try:
            self.storage.reset_block(block)  # whatever it held (an evicted prefix) is gone
        except BaseException:  # e.g. a quantized storage out of staging: the block must not leak
            self.pool.release(block)
            raise
        return block

    def _masks(self, visible: torch.Tensor, positions: torch.Tensor, cols: torch.Tensor):
        masks = self._mask_dict(visible, positions, cols)
        return masks if len(set(self.layer_types)) > 1 or "sliding_attention" in masks else masks["full_attention"]

    def _mask_dict(self, visible: torch.Tensor, positions: torch.Tensor, cols: torch.Tensor) -> dict:
        masks = {"full_attention": self._as_mask(visible)}
        if "sliding_attention" in self.layer_types and self.sliding_window:
            # as transformers' sliding overlay: a query at position p sees keys k with k > p - window
            near = cols[None, None, :] > positions[:, :, None] - self.sliding_window
            masks["sliding_attention"] = self._as_mask(visible & near)
        return masks

    def _as_mask(self, visible: torch.Tensor) -> torch.Tensor:
        mask = visible[:, None]  # [rows, 1, q, width]
        if self.mask_is_bool:
            return mask
        return torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(self.dtype).min)

    # --- accounting -------------------------------------------------------------------------------------------
    @property
    def bytes_per_block_held(self) -> int:
        return self.storage.nbytes // self.pool.num_blocks

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks live sequences reference (the pool itself is `storage.nbytes`)."""
        return self.pool.used * self.bytes_per_block_held


def _activation_dtype(model) -> torch.dtype:
    """The dtype keys/values come out of attention in: the engine's compute dtype (fp16-stored weights still run
    fp32 activations, see engine.precision)."""
    return compute_dtype(model)
