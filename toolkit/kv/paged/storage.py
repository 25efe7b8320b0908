"""Where the paged cache's keys and values physically live: one tensor per layer for keys and one for values, each
[kv_heads, num_blocks * block_size, head_dim]. Token t of block b sits at slot b * block_size + t.

Slots are token-major within a head so that reading a batch through its block tables is one `index_select` along
dim 1 per tensor, whose result views as [heads, rows, width, head_dim] and transposes (no copy) into the
[rows, heads, width, head_dim] attention takes. The buffers start zeroed: gathered padding columns are masked, but
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
        shape = (kv_heads, num_blocks * block_size, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size, self.dtype = block_size, dtype

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values [rows, heads, q, dim] to `slots` [rows * q] (row-major)."""
        heads, dim = keys.shape[1], keys.shape[3]
        self.keys[layer].index_copy_(1, slots, keys.transpose(0, 1).reshape(heads, -1, dim))
        self.values[layer].index_copy_(1, slots, values.transpose(0, 1).reshape(heads, -1, dim))

    def gather(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [rows, heads, width, dim] of the slots `index` [rows, width]."""
        rows, width = index.shape
        flat = index.reshape(-1)
        k = self.keys[layer].index_select(1, flat)
        v = self.values[layer].index_select(1, flat)
        return (k.view(k.shape[0], rows, width, -1).transpose(0, 1),
                v.view(v.shape[0], rows, width, -1).transpose(0, 1))

    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        for tensors in (self.keys, self.values):
            for t in tensors:
                t[:, dst * bs:(dst + 1) * bs] = t[:, src * bs:(src + 1) * bs]

    def reset_block(self, block: int) -> None:
        pass

    def is_sealed(self, block: int) -> bool:
        return False

    def seal_block(self, block: int) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
