"""Quantized paged KV blocks (INT8/INT4/INT2, KIVI-style): the storage `PagedKVCache` reads and writes through when
`kv=int8|int4|int2` (`paged_storage_for` picks it from a kv config; the interface is in storage.py).

A block is in one of two states:
  * unsealed (the partial tail and the recent `residual_tokens` window): its tokens live in full precision in a
    *staging slot*, one of `staging_slots` block-sized buffers much fewer than the blocks; the block maps to it;
  * sealed (a full block its sequence left `residual_tokens` behind): quantized with toolkit.kv.quantize's
    primitives, keys per channel over the block's tokens (one key group = one block: block_size plays
    kv.group_size for keys), values per token over groups of Gv = min(kv.group_size, head_dim) channels, fp16
    scale and minimum, codes packed along the head dim. Sealing gives its staging slot back.

Layout per layer (L layers, H kv heads, D head dim, N blocks of B tokens, S staging slots, b bits), slot-major as FP blocks:
    k_codes, v_codes    uint8 [H, N*B, D*b/8]
    k_scale, k_min      fp16  [H, N, D]          (per channel per block)
    v_scale, v_min      fp16  [H, N*B, D/Gv]     (per token per channel group)
    k_stage, v_stage    act   [H, S*B, D]
so, exactly (e = the activations' element size, 4 for fp32, 2 for bf16):
    bytes_per_block = L * H * (2*B*D*b/8 + 2*D*2 + 2*B*(D/Gv)*2)   (codes; fp16 scale+min of keys, of values)
    bytes_per_staging_slot = L * H * 2*B*D*e
    nbytes = N * bytes_per_block + S * bytes_per_staging_slot

Staging is the scarce resource. After a commit a sequence holds at most ceil(R / B) + 1 unsealed blocks (R =
residual_tokens), and ceil((R + q) / B) + 1 while a call adding q tokens is bound; a prefill adding P tokens to a
fresh sequence holds ceil(P / B) until its commit seals them (`staging_slots_for`, `plan_pool`). A block keeps its
slot while it is free or cached in the pool; once the storage is `attach`ed to the pool it takes slots back from
free blocks, then evicts least recently used cached unsealed blocks (the pool would evict them anyway; evicting,
not sealing, keeps every block's state the one its sequences expect). Only when every slot belongs to a block some
live sequence references does it raise OutOfBlocks. `paged_cache_for` builds the cache and attaches; a storage
passed to `PagedKVCache(..., storage=...)` by hand needs `storage.attach(cache.pool)`.

Sealing is deferred: `seal_block` marks the block and the next read or write quantizes every pending block at once
(one quantize per layer for a whole prefill, not one per block). `gather` dequantizes the sealed slots it is asked
for and reads the rest from staging, with one index_select per tensor (no loop over tokens or blocks).
"""

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch

from toolkit.errors import InputError
from toolkit.kv import kv_spec, native
from toolkit.kv.config import compute_dtype
from toolkit.kv.memory import model_kv_shape
from toolkit.kv.paged.cache import PagedKVCache
from toolkit.kv.paged.pool import OutOfBlocks
from toolkit.kv.paged.storage import FPBlockStorage
from toolkit.kv.quantize import (
    ALLOWED_BITS,
    CLIP_GRID,
    STORE_DTYPE,
    dequantize_groups,
    pack,
    quantize_groups,
    unpack,
)

log = logging.getLogger(__name__)

_NO_SLOT = -1


class QuantizedBlockStorage:
    """Blocks sealed to `bits`-bit codes once `residual_tokens` behind their sequence's end; staged in full precision
    (in `staging_slots` block buffers) until then."""

    kind = "quantized"

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device="cpu", *, bits: int, residual_tokens: int, staging_slots: int,
                 value_group: int = 32, value_clip: bool = False, fused: bool = True):
        if bits not in ALLOWED_BITS:
            raise InputError(f"kv.bits={bits} is not supported", f"use kv.bits one of {ALLOWED_BITS}")
        vg = min(value_group, head_dim)
        if head_dim % vg or head_dim * bits % 8:
            raise InputError(f"head dim {head_dim} is not a multiple of kv.group_size={value_group}",
                             "use kv.group_size dividing the head dim, or kv=fp")
        if residual_tokens < 0:
            raise InputError(f"kv.residual={residual_tokens} is negative", "use kv.residual >= 0")
        if not 1 <= staging_slots <= num_blocks:
            raise InputError(f"{staging_slots} staging slots for {num_blocks} blocks",
                             "use 1 <= staging_slots <= num_blocks (see staging_slots_for / plan_pool)")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.kv_heads, self.head_dim, self.dtype, self.device = kv_heads, head_dim, dtype, device
        self.bits, self.residual_tokens, self.value_group, self.staging_slots = bits, residual_tokens, vg, staging_slots
        self.clip_grid = CLIP_GRID if value_clip else None
        # reads through the fused kernel (toolkit/kv/native.py) where it builds; plain 8-bit codes stay on torch's
        # copy, as in the contiguous cache. False (kv.dequant=torch): torch ops, the same values
        self.fused = (fused and bits < 8 and dtype in (torch.float32, torch.bfloat16)
                      and torch.device(device).type == "cpu")
        H, D, NB = kv_heads, head_dim, num_blocks * block_size
        u8, f16 = dict(dtype=torch.uint8, device=device), dict(dtype=STORE_DTYPE, device=device)
        # zeroed, not empty: gathered padding columns are masked but still enter attention's matmul (storage.py)
        self.k_codes = [torch.zeros(H, NB, D * bits // 8, **u8) for _ in range(num_layers)]
        self.v_codes = [torch.zeros(H, NB, D * bits // 8, **u8) for _ in range(num_layers)]
        self.k_scale = [torch.zeros(H, num_blocks, D, **f16) for _ in range(num_layers)]
        self.k_min = [torch.zeros(H, num_blocks, D, **f16) for _ in range(num_layers)]
        self.v_scale = [torch.zeros(H, NB, D // vg, **f16) for _ in range(num_layers)]
        self.v_min = [torch.zeros(H, NB, D // vg, **f16) for _ in range(num_layers)]
        stage = (H, staging_slots * block_size, D)
        self.k_stage = [torch.zeros(stage, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_stage = [torch.zeros(stage, dtype=dtype, device=device) for _ in range(num_layers)]
        # block state, kept twice: Python lists for the cache's per-block questions, tensors for vectorised reads
        self.sealed = [False] * num_blocks
        self.slot_of = [_NO_SLOT] * num_blocks
        self.owner = [_NO_SLOT] * staging_slots  # staging slot -> block holding it
        self.free_slots = list(range(staging_slots - 1, -1, -1))  # pop() hands out low slots first
        self._sealed_t = torch.zeros(num_blocks, dtype=torch.bool, device=device)
        self._slot_t = torch.full((num_blocks,), _NO_SLOT, dtype=torch.long, device=device)
        self._pending: list[int] = []  # blocks marked sealed, not yet quantized
        self._version = 0  # bumped on every state change: the read plan below is cached per (index, version)
        self._plan_key, self._plan = None, None
        self.pool = None

    # --- sizes ----------------------------------------------------------------------------------------------------
    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, bits: int,
                        value_group: int = 32) -> int:
        """Codes and scales of one block (staging slots are counted apart: `bytes_per_staging_slot`)."""
        B, D, vg = block_size, head_dim, min(value_group, head_dim)
        per_head = 2 * B * D * bits // 8 + 2 * D * 2 + 2 * B * (D // vg) * 2
        return num_layers * kv_heads * per_head

    @staticmethod
    def bytes_per_staging_slot(num_layers: int, block_size: int, kv_heads: int, head_dim: int,
                               dtype: torch.dtype) -> int:
        return FPBlockStorage.bytes_per_block(num_layers, block_size, kv_heads, head_dim, dtype)

    @property
    def nbytes(self) -> int:
        return (self.num_blocks * self.bytes_per_block(self.num_layers, self.block_size, self.kv_heads, self.head_dim,
                                                       self.bits, self.value_group)
                + self.staging_slots * self.bytes_per_staging_slot(self.num_layers, self.block_size, self.kv_heads,
                                                                   self.head_dim, self.dtype))

    @property
    def tensor_bytes(self) -> int:
        """The bytes the tensors really hold (what `nbytes`' formula must equal)."""
        tensors = (self.k_codes + self.v_codes + self.k_scale + self.k_min + self.v_scale + self.v_min
                   + self.k_stage + self.v_stage)
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def staging_free(self) -> int:
        """Staging slots held by no block."""
        return len(self.free_slots)

    @property
    def staging_available(self) -> int:
        """Staging slots new blocks can get: free ones, plus (once attached) those of blocks no live sequence
        references. What admission should check besides `pool.available`: a prefill of P new tokens stages
        ceil(P / block_size) blocks until its commit."""
        if self.pool is None:
            return len(self.free_slots)
        return len(self.free_slots) + sum(b != _NO_SLOT and self.pool.ref_count[b] == 0 for b in self.owner)

    # --- the pool ---------------------------------------------------------------------------------------------------
    def attach(self, pool) -> None:
        """Let the storage take staging slots back from blocks the pool holds no live reference to."""
        if pool.num_blocks != self.num_blocks or pool.block_size != self.block_size:
            raise ValueError(f"storage of {self.num_blocks} x {self.block_size} attached to a pool of "
                             f"{pool.num_blocks} x {pool.block_size}")
        self.pool = pool

    # --- block states (the cache's hooks) -------------------------------------------------------------------------
    def is_sealed(self, block: int) -> bool:
        return self.sealed[block]

    def seal_block(self, block: int) -> None:
        if self.sealed[block]:
            return  # shared blocks are sealed by whichever sequence gets there first
        if self.slot_of[block] == _NO_SLOT:
            raise RuntimeError(f"block {block} is sealed before anything was written to it")
        self.sealed[block] = True
        self._pending.append(block)
        self._version += 1

    @torch.inference_mode()  # the cache calls it outside the model call; the buffers may be inference tensors
    def reset_block(self, block: int) -> None:
        self.settle()
        self.sealed[block] = False
        self._sealed_t[block] = False
        if self.slot_of[block] == _NO_SLOT:
            self._give_slot(block, self._take_slot())
        self._version += 1

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int) -> None:
        """dst (just reset) takes src's state: its codes and scales if sealed, else its staged tokens."""
        self.settle()
        B = self.block_size
        if self.sealed[src]:
            s, d = slice(src * B, (src + 1) * B), slice(dst * B, (dst + 1) * B)
            for layer in range(self.num_layers):
                for t in (self.k_codes, self.v_codes, self.v_scale, self.v_min):
                    t[layer][:, d] = t[layer][:, s]
                for t in (self.k_scale, self.k_min):
                    t[layer][:, dst] = t[layer][:, src]
            if self.slot_of[dst] != _NO_SLOT:
                self._drop_slot(dst)
            self.sealed[dst] = True
            self._sealed_t[dst] = True
        else:
            if self.slot_of[src] == _NO_SLOT or self.slot_of[dst] == _NO_SLOT:
                raise RuntimeError(f"copy of block {src} to {dst}: an unsealed block without a staging slot")
            s = slice(self.slot_of[src] * B, (self.slot_of[src] + 1) * B)
            d = slice(self.slot_of[dst] * B, (self.slot_of[dst] + 1) * B)
            for layer in range(self.num_layers):
                self.k_stage[layer][:, d] = self.k_stage[layer][:, s]
                self.v_stage[layer][:, d] = self.v_stage[layer][:, s]
        self._version += 1

    # --- reads and writes -----------------------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values [rows, heads, q, dim] to `slots` [rows * q] (row-major); always into unsealed blocks."""
        self.settle()
        B = self.block_size
        blocks = slots // B
        staged = self._slot_t[blocks]
        if layer == 0 and bool((staged == _NO_SLOT).any()):  # the cache never writes a sealed block: a bug if so
            bad = sorted({int(b) for b in blocks[staged == _NO_SLOT]})
            raise RuntimeError(f"write into blocks {bad} that are sealed or were never handed out")
        index = staged * B + slots % B
        heads, dim = keys.shape[1], keys.shape[3]
        self.k_stage[layer].index_copy_(1, index, keys.transpose(0, 1).reshape(heads, -1, dim))
        self.v_stage[layer].index_copy_(1, index, values.transpose(0, 1).reshape(heads, -1, dim))

    def gather(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [rows, heads, width, dim] of the slots `index` [rows, width], in the activation dtype:
        sealed slots dequantized, the others read from staging."""
        self.settle()
        rows, width = index.shape
        sealed_pos, sealed_slots, sealed_blocks, open_pos, open_index = self._read_plan(index)
        H, D, n = self.kv_heads, self.head_dim, rows * width
        if not len(sealed_pos):  # nothing sealed yet (short sequences): staging alone
            k = self.k_stage[layer].index_select(1, open_index)
            v = self.v_stage[layer].index_select(1, open_index)
        else:
            k = torch.empty(H, n, D, dtype=self.dtype, device=self.device)
            v = torch.empty_like(k)
            dk, dv = self._dequantize(layer, sealed_slots, sealed_blocks)
            k.index_copy_(1, sealed_pos, dk)
            v.index_copy_(1, sealed_pos, dv)
            if len(open_pos):
                k.index_copy_(1, open_pos, self.k_stage[layer].index_select(1, open_index))
                v.index_copy_(1, open_pos, self.v_stage[layer].index_select(1, open_index))
        return k.view(H, rows, width, D).transpose(0, 1), v.view(H, rows, width, D).transpose(0, 1)

    def _read_plan(self, index: torch.Tensor):
        """Which columns of `index` are sealed and where every column is read from. The same index is gathered by
        every layer of a call, so the plan is computed once per (index, state)."""
        key = (index, self._version)
        if self._plan_key is not None and self._plan_key[0] is index and self._plan_key[1] == self._version:
            return self._plan
        B = self.block_size
        flat = index.reshape(-1)
        blocks = flat // B
        sealed = self._sealed_t[blocks]
        sealed_pos = sealed.nonzero().squeeze(1)
        open_pos = (~sealed).nonzero().squeeze(1)
        # unsealed blocks without a slot are padding (slot 0 of a free block): any finite staged value will do
        open_slots = flat[open_pos]
        open_index = self._slot_t[open_slots // B].clamp_min(0) * B + open_slots % B
        # key scales are per block: read each sealed block's once (as fp32) and expand per slot from there
        sealed_blocks, per_slot = torch.unique(blocks[sealed_pos], return_inverse=True)
        self._plan_key = key  # holds `index`, so its id cannot be reused by another tensor while cached
        self._plan = (sealed_pos, flat[sealed_pos], (sealed_blocks, per_slot), open_pos, open_index)
        return self._plan

    def _dequantize(self, layer: int, slots: torch.Tensor, blocks: tuple[torch.Tensor, torch.Tensor]):
        """Keys and values [H, m, D] of m sealed slots; `blocks`: their distinct blocks and each slot's rank there."""
        H, D, vg, m = self.kv_heads, self.head_dim, self.value_group, len(slots)
        distinct, rank = blocks
        if self.fused and native.kernel() is not None:  # one pass per tensor, the same values as the ops below
            k = torch.empty(H, m, D, dtype=self.dtype, device=self.device)
            v = torch.empty_like(k)
            native.dequantize_gather("keys", self.k_codes[layer], slots, self.k_scale[layer].index_select(1, distinct),
                                     self.k_min[layer].index_select(1, distinct), k, self.bits, scale_index=rank)
            native.dequantize_gather("values", self.v_codes[layer], slots, self.v_scale[layer].index_select(1, slots),
                                     self.v_min[layer].index_select(1, slots), v, self.bits, vg)
            return k, v
        kc = unpack(self.k_codes[layer].index_select(1, slots), self.bits)
        k_scale = self.k_scale[layer].index_select(1, distinct).float().index_select(1, rank)
        k_min = self.k_min[layer].index_select(1, distinct).float().index_select(1, rank)
        k = dequantize_groups(kc, k_scale, k_min, self.dtype)
        vc = unpack(self.v_codes[layer].index_select(1, slots), self.bits).view(H, m, D // vg, vg)
        v = dequantize_groups(vc, self.v_scale[layer].index_select(1, slots)[..., None],
                              self.v_min[layer].index_select(1, slots)[..., None], self.dtype)
        return k, v.view(H, m, D)

    # --- sealing ------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def settle(self) -> None:
        """Quantize every block marked sealed since the last read or write (all at once) and free their slots."""
        if not self._pending:
            return
        blocks, self._pending = self._pending, []
        B, H, D, vg, n = self.block_size, self.kv_heads, self.head_dim, self.value_group, len(blocks)
        dev = self.device
        block_t = torch.tensor(blocks, dtype=torch.long, device=dev)
        stage_rows = (torch.tensor([self.slot_of[b] for b in blocks], device=dev)[:, None] * B
                      + torch.arange(B, device=dev)).reshape(-1)
        dest_rows = (block_t[:, None] * B + torch.arange(B, device=dev)).reshape(-1)
        for layer in range(self.num_layers):
            k = self.k_stage[layer].index_select(1, stage_rows).view(H, n, B, D)
            codes, scale, mn = quantize_groups(k, self.bits, dim=-2)  # per channel over the block's tokens
            self.k_codes[layer].index_copy_(1, dest_rows, pack(codes.view(H, n * B, D), self.bits))
            self.k_scale[layer].index_copy_(1, block_t, scale.view(H, n, D))
            self.k_min[layer].index_copy_(1, block_t, mn.view(H, n, D))
            v = self.v_stage[layer].index_select(1, stage_rows).view(H, n * B, D // vg, vg)
            codes, scale, mn = quantize_groups(v, self.bits, dim=-1, clip_grid=self.clip_grid)  # per token
            self.v_codes[layer].index_copy_(1, dest_rows, pack(codes.view(H, n * B, D), self.bits))
            self.v_scale[layer].index_copy_(1, dest_rows, scale.view(H, n * B, D // vg))
            self.v_min[layer].index_copy_(1, dest_rows, mn.view(H, n * B, D // vg))
        self._sealed_t[block_t] = True
        for block in blocks:
            self._drop_slot(block)
        self._version += 1

    # --- staging slots --------------------------------------------------------------------------------------------
    def _give_slot(self, block: int, slot: int) -> None:
        self.slot_of[block], self.owner[slot] = slot, block
        self._slot_t[block] = slot

    def _drop_slot(self, block: int) -> None:
        slot = self.slot_of[block]
        self.slot_of[block], self.owner[slot] = _NO_SLOT, _NO_SLOT
        self._slot_t[block] = _NO_SLOT
        self.free_slots.append(slot)

    def _take_slot(self) -> int:
        if not self.free_slots and self.pool is not None:
            self._reclaim()
        if not self.free_slots:
            held = "" if self.pool is not None else (" (the storage is not attached to the pool, so idle blocks "
                                                     "keep theirs: call storage.attach(cache.pool))")
            raise OutOfBlocks(f"all {self.staging_slots} full-precision staging slots of the quantized KV blocks "
                              f"are held by unsealed blocks{held}; give the storage more staging_slots "
                              f"(plan_pool / staging_slots_for), or run fewer sequences or shorter prefill chunks")
        return self.free_slots.pop()

    def _reclaim(self) -> None:
        """Take staging slots back from blocks no live sequence references: free ones first (nothing can ask for
        their tokens), else the least recently used cached ones, which are evicted from the pool."""
        pool = self.pool
        idle = [b for b in self.owner if b != _NO_SLOT and pool.ref_count[b] == 0]
        free = [b for b in idle if not pool.is_registered(b)]
        for block in free:
            self._drop_slot(block)
        if free:
            return
        for block in list(pool.cached):  # oldest first
            if self.slot_of[block] != _NO_SLOT:
                pool.evict(block)
                self._drop_slot(block)
                return


# --- sizing -------------------------------------------------------------------------------------------------------
def staging_slots_for(block_size: int, residual_tokens: int, max_sequences: int, step_tokens: int = 1,
                      prefill_tokens: int = 0) -> int:
    """Staging slots that `max_sequences` sequences decoding `step_tokens` per call need at most (each
    ceil((R + q) / B) + 1 unsealed blocks while bound), plus a prefill of `prefill_tokens` in one call."""
    per_sequence = math.ceil((residual_tokens + step_tokens) / block_size) + 1
    return max_sequences * per_sequence + math.ceil(prefill_tokens / block_size)


@dataclass(frozen=True)
class PoolPlan:
    num_blocks: int
    staging_slots: int
    nbytes: int  # what the storage will hold (<= the budget)


def plan_pool(model, kv, budget_bytes: int, block_size: int = 16, max_sequences: int = 8,
              step_tokens: int = 1, prefill_tokens: int = 0) -> PoolPlan:
    """Blocks and staging slots a quantized storage gets from `budget_bytes`: staging for `max_sequences` (see
    `staging_slots_for`), the rest in blocks."""
    cfg = _quant_cfg(kv)
    shape, dtype = model_kv_shape(model), compute_dtype(model)
    per_block = QuantizedBlockStorage.bytes_per_block(shape["layers"], block_size, shape["kv_heads"],
                                                      shape["head_dim"], cfg.bits, cfg.group_size)
    per_slot = QuantizedBlockStorage.bytes_per_staging_slot(shape["layers"], block_size, shape["kv_heads"],
                                                            shape["head_dim"], dtype)
    slots = staging_slots_for(block_size, cfg.residual, max_sequences, step_tokens, prefill_tokens)
    blocks = (budget_bytes - slots * per_slot) // per_block
    if blocks < slots:
        raise InputError(f"a KV budget of {budget_bytes} bytes cannot hold {slots} staging slots "
                         f"({per_slot} bytes each) and as many {per_block}-byte blocks",
                         "raise the budget, or lower max_sequences, prefill_tokens or kv.residual")
    return PoolPlan(blocks, slots, blocks * per_block + slots * per_slot)


# --- from a KVSpec ----------------------------------------------------------------------------------------------
def _quant_cfg(kv):
    cfg = kv_spec(kv).quant
    if cfg is None:
        raise InputError("kv=fp has no quantization options", "use kv=int8, int4 or int2")
    if cfg.hierarchical:
        raise InputError("kv.hierarchical=true is not supported by the paged cache",
                         "use kv.hierarchical=false with paged serving")
    if cfg.dequant == "cached":  # full: the fused kernel where it builds; torch: torch ops
        raise InputError(f"kv.dequant={cfg.dequant!r} is not supported by the paged cache", "use kv.dequant=full")
    if cfg.sink or cfg.pre_rope:  # defaults (sink 1; pre_rope at 2 bits), so a log line rather than a refusal
        level = logging.WARNING if cfg.pre_rope else logging.INFO  # at 2 bits the missing pre-RoPE costs quality
        log.log(level, "the paged cache keeps no sink tokens and quantizes keys after RoPE: kv.sink=%d and "
                "kv.pre_rope=%s apply to the engine's contiguous cache only (docs/kv-cache.md)",
                cfg.sink, cfg.pre_rope)
        cfg = dataclasses.replace(cfg, sink=0, pre_rope=False)
    return cfg


def paged_storage_for(model, kv, num_blocks: int, block_size: int = 16, staging_slots: int | None = None,
                      max_sequences: int = 8, step_tokens: int = 1, prefill_tokens: int = 2048):
    """The block storage a `PagedKVCache` of `num_blocks` x `block_size` needs for `kv` (a KVSpec, or None =
    fp): FPBlockStorage for kv=fp, QuantizedBlockStorage for int8/int4/int2 (kv.residual is its
    residual_tokens, kv.group_size its value channel group; keys are grouped by block). Without `staging_slots`,
    as many as `staging_slots_for` says, at most num_blocks."""
    shape, dtype = model_kv_shape(model), compute_dtype(model)
    device = next(model.parameters()).device
    dims = (shape["layers"], num_blocks, block_size, shape["kv_heads"], shape["head_dim"], dtype, device)
    if not kv_spec(kv).quantized:
        return FPBlockStorage(*dims)
    cfg = _quant_cfg(kv)
    if staging_slots is None:
        staging_slots = min(num_blocks, staging_slots_for(block_size, cfg.residual, max_sequences, step_tokens,
                                                          prefill_tokens))
    return QuantizedBlockStorage(*dims, bits=cfg.bits, residual_tokens=cfg.residual, staging_slots=staging_slots,
                                 value_group=cfg.group_size, value_clip=cfg.value_clip, fused=cfg.dequant != "torch")


def paged_cache_for(model, kv, num_blocks: int, block_size: int = 16, prefix_cache: bool = True,
                    **storage_options):
    """A `PagedKVCache` on `paged_storage_for`'s storage, attached to its pool (see `QuantizedBlockStorage.attach`)."""

    storage = paged_storage_for(model, kv, num_blocks, block_size, **storage_options)
    cache = PagedKVCache(model, num_blocks, block_size, storage=storage, prefix_cache=prefix_cache)
    if hasattr(storage, "attach"):
        storage.attach(cache.pool)
    return cache
