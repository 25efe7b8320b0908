"""A "slot" KV cache for continuous batching: one row per running sequence, each row with its own length.

The engine's ContiguousKVCache keeps every row of a batch at one length (left padding), so a sequence can only join
a batch when the batch starts. Here each row holds one sequence packed from column 0 with its own length; a decode
step writes each row's new key/value at that row's length (an index scatter) and attends over the widest row's
columns behind a per-row mask, so rows of different lengths decode together. A joining sequence is prefilled alone
and its keys/values copied into the next free row; a leaving one is replaced by the last row (rows stay compact, so a
step runs on exactly the live rows and nothing else).

Buffers grow along the token axis (doubling, never shrinking) up to `max_length`, so memory follows the longest
sequence seen rather than the worst case; they start zeroed because masked columns still enter attention's matmul
(0 x NaN would poison a row, stale finite values are harmless).
"""

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

_MIN_CAPACITY = 256


class SlotKVLayer(CacheLayerMixin):
    """One layer's keys and values in buffers [max_batch, kv_heads, capacity, head_dim]."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, owner: "SlotKVCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, heads, _, k_dim = key_states.shape
        kw = dict(dtype=key_states.dtype, device=key_states.device)
        self.device = key_states.device
        self.key_buffer = torch.zeros(self.owner.max_batch, heads, self.owner.capacity, k_dim, **kw)
        self.value_buffer = torch.zeros(self.owner.max_batch, heads, self.owner.capacity, value_states.shape[-1], **kw)
        self.is_initialized = True

    def grow(self, capacity: int) -> None:
        if not self.is_initialized or self.key_buffer.shape[2] >= capacity:
            return
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], old.shape[1], capacity, old.shape[3])
            new[:, :, :old.shape[2]] = old
            setattr(self, name, new)

    def write_row(self, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Place one sequence's prefilled keys/values [kv_heads, T, head_dim] at columns [0, T) of `row`."""
        if not self.is_initialized:
            self.lazy_initialization(keys[None], values[None])
        length = keys.shape[1]
        self.key_buffer[row, :, :length] = keys
        self.value_buffer[row, :, :length] = values

    def move_row(self, src: int, dst: int, length: int) -> None:
        if self.is_initialized:
            self.key_buffer[dst, :, :length] = self.key_buffer[src, :, :length]
            self.value_buffer[dst, :, :length] = self.value_buffer[src, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """A decode step: key_states [n, kv_heads, 1, head_dim] go to column lengths[r] of rows r < n."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self.owner
        if key_states.shape[2] != 1 or key_states.shape[0] != owner.rows:
            raise RuntimeError("the slot cache takes one new token per live row; prefill into a ContiguousKVCache")
        rows = owner.row_index[:owner.rows]
        cols = owner.lengths[:owner.rows]
        self.key_buffer[rows, :, cols] = key_states[:, :, 0]
        self.value_buffer[rows, :, cols] = value_states[:, :, 0]
        self.keys = self.key_buffer[:owner.rows, :, :owner.width]
        self.values = self.value_buffer[:owner.rows, :, :owner.width]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width, 0

    def get_seq_length(self) -> int:
        return self.owner.width - 1 if self.owner.rows else 0

    def get_max_length(self) -> int:
        return self.owner.max_length


class SlotKVCache(Cache):
    """Keys/values for up to `max_batch` sequences of up to `max_length` tokens each, one row per sequence.

    A decode step: `begin_step()` -> (positions, masks) for the model call, the model writes through `update`, then
    `end_step()` advances every live row by one token. The live rows are 0..rows-1."""

    def __init__(self, model, max_batch: int, max_length: int):
        config = model.config.get_text_config(decoder=True)
        self.max_batch, self.max_length = max_batch, max_length
        self.capacity = min(max_length, _MIN_CAPACITY)
        super().__init__(layers=[SlotKVLayer(self) for _ in range(config.num_hidden_layers)])
        device = next(model.parameters()).device
        self.lengths = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.row_index = torch.arange(max_batch, device=device)
        self.rows = 0  # live rows
        self.width = 0  # columns attention sees this step: the longest live row + its new token
        self.layer_types = list(getattr(config, "layer_types", None) or [])
        self.sliding_window = getattr(config, "sliding_window", None)
        self.mask_is_bool = config._attn_implementation in ("sdpa", "flex_attention", None)
        if config._attn_implementation not in ("sdpa", "eager", None):
            raise NotImplementedError(f"slot cache masks for attention {config._attn_implementation!r}")
        self.dtype = next(model.parameters()).dtype

    # --- rows joining and leaving ---------------------------------------------------------------------------
    def add_row(self, prefilled) -> int:
        """Copy a batch-1 prefilled cache (ContiguousKVCache) into the next row; returns the row."""
        if self.rows >= self.max_batch:
            raise RuntimeError("slot cache full")
        row, length = self.rows, prefilled.length
        self._ensure_capacity(length + 1)
        for layer, source in zip(self.layers, prefilled.layers):
            layer.write_row(row, source.keys[0], source.values[0])
        self.lengths[row] = length
        self.rows += 1
        return row

    def remove_row(self, row: int) -> int | None:
        """Free `row`; the last live row moves into it (returns the row that moved, or None)."""
        last = self.rows - 1
        moved = None
        if row != last:
            length = int(self.lengths[last])
            for layer in self.layers:
                layer.move_row(last, row, length)
            self.lengths[row] = self.lengths[last]
            moved = last
        self.lengths[last] = 0
        self.rows -= 1
        return moved

    def _ensure_capacity(self, tokens: int) -> None:
        if tokens > self.max_length:
            raise RuntimeError(f"a row of {tokens} tokens exceeds the slot cache's max_length {self.max_length}")
        if tokens <= self.capacity:
            return
        capacity = self.capacity
        while capacity < tokens:
            capacity *= 2
        self.capacity = min(capacity, self.max_length)
        for layer in self.layers:
            layer.grow(self.capacity)

    # --- one decode step --------------------------------------------------------------------------------------
    def begin_step(self):
        """Positions [rows, 1] of the new tokens and the attention mask(s) the model takes for this step."""
        lengths = self.lengths[:self.rows]
        self.width = int(lengths.max()) + 1
        self._ensure_capacity(self.width)
        cols = torch.arange(self.width, device=lengths.device)[None, :]
        visible = cols <= lengths[:, None]  # the row's own past and its new token; later columns are other rows'
        masks = {"full_attention": self._as_mask(visible)}
        if "sliding_attention" in self.layer_types and self.sliding_window:
            # as transformers' sliding overlay: a query at position q sees keys k with k > q - window
            masks["sliding_attention"] = self._as_mask(visible & (cols > lengths[:, None] - self.sliding_window))
        # models with several layer types take a dict keyed by type; others one 4-D mask
        mask = masks if len(set(self.layer_types)) > 1 or "sliding_attention" in masks else masks["full_attention"]
        return lengths[:, None].clone(), mask

    def _as_mask(self, visible: torch.Tensor) -> torch.Tensor:
        mask = visible[:, None, None, :]  # [rows, 1, query=1, width]
        if self.mask_is_bool:
            return mask
        return torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(self.dtype).min)

    def end_step(self) -> None:
        self.lengths[:self.rows] += 1

    # --- accounting -------------------------------------------------------------------------------------------
    def _bytes_per_token(self) -> int:
        layer = self.layers[0]
        if not layer.is_initialized:
            return 0
        return sum(l.key_buffer[0, :, 0].numel() * l.key_buffer.element_size()
                   + l.value_buffer[0, :, 0].numel() * l.value_buffer.element_size()
                   for l in self.layers if l.is_initialized)

    @property
    def tokens_in_use(self) -> int:
        return int(self.lengths[:self.rows].sum()) if self.rows else 0

    @property
    def nbytes(self) -> int:
        """Bytes the live rows' filled columns hold."""
        return self.tokens_in_use * self._bytes_per_token()

    @property
    def allocated_bytes(self) -> int:
        return self.max_batch * self.capacity * self._bytes_per_token()
