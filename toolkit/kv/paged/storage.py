"""Where the paged cache's keys and values physically live: one tensor per layer for keys and one for values, each
[num_blocks * block_size, kv_heads, head_dim], views of one [slots, 2, kv_heads, head_dim] tensor per layer (a
token's keys then its values). Token t of block b sits at slot b * block_size + t.

Slots are the outermost dimension so that reading a batch through its block tables is one `index_select` along
dim 0 per layer, copying each token's keys and values as one contiguous run; the result views as [rows, width, heads, dim] and
permutes (no copy) into the [rows, heads, width, dim] attention takes. Measured with cold caches (as inside a
forward pass, where the weights have just streamed through), gathering 8 x 304 tokens of SmolLM2's 3 x 64 heads
took 92 us this way and 243 us with the slots inside each head ([heads, slots, dim]): scattered 256-byte rows are
latency-bound, 768-byte rows run at copy speed. The buffers start zeroed: gathered padding columns are masked, but
still enter attention's matmul, where 0 x NaN from uninitialised memory would poison a row.

The interface the cache uses (a quantized storage implements the same):
  write(layer, slots, keys, values), gather(layer, index) -> (keys, values) in the activation dtype,
  copy_block(src, dst) (copy-on-write; copies whatever state src is in), nbytes, bytes_per_block(...),
  residual_tokens: None if blocks are never sealed; else a full block is sealed once the sequence holding it is this
    many tokens past its end (`seal_block(block)`, idempotent: a block shared by several sequences may be sealed by
    any of them, with the same result), `is_sealed(block)`, and `reset_block(block)` when the pool hands a block out
    anew (it starts unsealed and empty).
"""

import torch


class FPBlockStorage:
    """Full-precision blocks (the model's activation dtype)."""

    kind = "fp"
    residual_tokens = None  # fp blocks are never sealed

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device="cpu"):
        shape = (num_blocks * block_size, 2, kv_heads, head_dim)
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.keys = [t[:, 0] for t in self.kv]
        self.values = [t[:, 1] for t in self.kv]
        self._workspace = None  # gather output, shared by all layers (see gather)
        self.block_size, self.dtype = block_size, dtype

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values [rows, heads, q, dim] to `slots` [rows * q] (row-major)."""
        heads, dim = keys.shape[1], keys.shape[3]
        self.keys[layer].index_copy_(0, slots, keys.transpose(1, 2).reshape(-1, heads, dim))
        self.values[layer].index_copy_(0, slots, values.transpose(1, 2).reshape(-1, heads, dim))

    def gather(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [rows, heads, width, dim] of the slots `index` [rows, width].

        They are written into one workspace shared by every layer (grown to the largest batch seen, never shrunk):
        attention consumes a layer's keys/values before the next layer gathers, so the views stay valid exactly as
        long as they are used, and a serving loop whose batch changes shape every step does not allocate (and
        fragment) a differently sized tensor per layer per step."""
        rows, width = index.shape
        source = self.kv[layer]
        n = rows * width
        held = 0 if self._workspace is None else self._workspace.shape[0]
        if held < n:  # grow at least twofold, so a slowly growing batch reallocates rarely
            self._workspace = source.new_empty((max(n, 2 * held), *source.shape[1:]))
        kv = torch.index_select(source, 0, index.reshape(-1), out=self._workspace[:n])
        kv = kv.view(rows, width, *kv.shape[1:]).transpose(2, 3)  # [rows, width, heads, 2, dim]
        return kv[..., 0, :].transpose(1, 2), kv[..., 1, :].transpose(1, 2)

    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        for t in self.kv:
            t[dst * bs:(dst + 1) * bs] = t[src * bs:(src + 1) * bs]

    def reset_block(self, block: int) -> None:
        pass

    def is_sealed(self, block: int) -> bool:
        return False

    def seal_block(self, block: int) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)
