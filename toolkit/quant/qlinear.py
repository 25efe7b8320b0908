"""`QuantLinear`: the runtime Linear layer that holds packed low-bit weights and runs real low-bit kernels.

Built from a `QuantizedWeight` (codes + scale + integer zero point, GPTQ convention ``w = (q - zero) * scale``) by
`QuantLinear.from_quantized`. Afterwards no float copy of the weight exists: only packed codes, their scales and
zero points, and the bias, all as buffers. Which path a layer runs is recorded in ``self.kernel``:

* ``"int8pack"`` -- bits=8, symmetric, one group per output channel (``group_size=-1``), ``in_features % 16 == 0``,
  CPU: int8 codes ``q - 128`` for specquant's int8 GEMM (`toolkit.quant.int8_native`, fp32, where it builds and
  ``out_features % 16 == 0``; ``int8_native`` is then True and the codes are held in its h16 order,
  ``weight_int8_h16``) or for ``aten._weight_int8pack_mm`` ([out, in], ``weight_int8``; per-channel symmetric, so a
  grouped or asymmetric 8-bit weight cannot use it and takes ``"dequant"``). `int8_rows` gives [out, in] either way.
* ``"int4n8"`` -- bits=4, ``g_idx`` None or trivial, CPU, ``out_features % 8 == 0``, even ``in_features`` and group
  size (a short last group is fine), and specquant's own AVX2 int4 GEMM built here (`toolkit.quant.int4_native`;
  ``QuantLinear.native_kernels``, ``engine.lowbit_kernel``): its "n8" layout (codes in blocks of 8 output channels, fp32
  scales and uint8 zero points beside them), fp32 activations, the bias added in the kernel. Products equal the
  dequantized weight's to fp32 rounding, and on AVX2 it is ~2.5x faster than torch's int4 kernel at one row.
* ``"int4pack"`` -- where the above does not build: bits=4, ``g_idx`` None or trivial, CPU, and the int4 kernel's shape rules hold (group size in
  32/64/128/256 -- a per-channel weight uses the largest of those dividing ``in_features`` with the scales
  repeated --, ``out_features % 16 == 0``): ``aten._convert_weight_to_int4pack_for_cpu`` layout, the integer zero
  point mapped to the kernel's float zero ``(8 - zero) * scale``. The kernel needs ``in_features % group == 0``; a
  ragged last group (SmolLM2's 576 at 128) runs zero-padded: codes padded to the next whole group, x padded with
  zeros on each call (``kernel_in``), so the padded codes never count.
* **act-order** (``g_idx`` not ``i // group``, GPTQ's desc_act): where every group holds ``group`` input channels
  (the last one the rest), as act-order GPTQ's do, the codes' columns are sorted by group once at load
  (``in_perm``, int32 [in]: column j of the held codes is input channel ``in_perm[j]``) and every product first
  gathers its inputs in that order (``x.index_select(-1, in_perm)``), so the layer runs the kernels above like a
  plain grouped one (the exllama/vLLM way of running desc_act). Other ``g_idx`` take ``"dequant"``.
* ``"dequant"`` -- everything else (2/3 bits, 8-bit grouped or asymmetric, 4-bit shapes the kernel refuses,
  ``g_idx`` whose groups are not of one size, non-CPU devices: the CUDA tinygemm packing is not implemented here).
  Codes are stored as ``uint8``: 4 bits two per byte (`pack_int4_rows`, low nibble first), 2 bits four per byte
  (code ``4j+i`` in bits ``2i..2i+1`` of byte ``j``), 3 and 8 bits one code per byte (3-bit packing would save
  5/8 of the bytes but needs a bit stream that straddles bytes; not done). Odd widths that do not divide fall back
  to one code per byte.
  forward dequantizes block by block (output rows, ~16 MB of float per block) into the compute dtype and runs
  ``F.linear``.

forward(x [..., in]) with ``rows = x.numel() // in``:

* int4n8 layers, ``rows < self.kernel_max_rows``: specquant's int4 GEMM in fp32.
* other kernel layers, ``rows < self.kernel_max_rows``: the kernel with **bfloat16** activations (the only vectorized
  path on x86; fp32/fp16 activations run a scalar loop 5-60x slower and are never used), x cast in and the result
  cast back to x's dtype. The same path applies on CPUs with native bf16.
* int8pack layers, ``rows >= INT8_DYNAMIC_MIN_ROWS`` (prefill): int8 x int8 (`toolkit.quant.int8_dynamic`): the
  activations quantized per row to 7 bits on each call, the 16 largest input channels kept in fp32, oneDNN's
  u8 x s8 GEMM on a per-call reordered copy of the same int8 codes (no second copy held). Not exact: ~1-2% relative
  error per product on Gaussian inputs, ~3-6% on SmolLM2's real activations (end to end: KL 0.021 against fp32,
  0.003 for the exact path; see docs/notes/2026-12-runtime-kernels-native-decoder.md, "int8 prefill"). `exact_prefill()` (or ``QuantLinear.int8_activations = False``)
  switches it off; autograd inputs, inputs holding inf/nan and torch builds without oneDNN take the exact path.
* otherwise: dequantize the weight to fp32 (x's dtype where the CPU multiplies it natively) and ``F.linear``.
  The dequantized values are ``(q - zero) * scale`` computed in fp32, exactly `QuantizedWeight.dequantize`'s.
  int4pack layers decode their codes from the kernel's packed layout (checked against the codes at construction;
  if this CPU's layout is not the one decoded here, a `pack_int4_rows` copy of the codes is kept for this path).

Thresholds, measured on AMD Zen 3 (AVX2, 2 threads, shared with other jobs) for a 1536x576 layer (SmolLM2's MLP
shape), int4 group 64 and int8 per-channel, fp32 in/out with casts and dequantization included, median
microseconds per call (`python benchmarks/qlinear_paths.py` prints a similar table)::

    rows                            4    16    32    48    64   128
    int4 kernel (bf16 act)        107   372   717  1050  1396  2768
    int4 dequant + fp32 F.linear 1243  1479  1694  1916  2186  2890
    int8 kernel (bf16 act)        108   365   705  1036  1365  2732
    int8 dequant + fp32 F.linear  721   866  1080  1267  1462  2541
    fp32 F.linear, float weight   267   363   605   790  1062  1722   (reference: no float weight is held here)
    (1 row: int4 kernel 84, int8 kernel 62, fp32 F.linear 82)

The dequantization alone takes ~470 us (int4, decoded from the kernel's packed layout) / ~150 us (int8), but the
F.linear that follows then runs ~400 us slower than on a weight that was not just written (measured: mul alone 123,
F.linear alone 349, the two in a row 866 us; row-blocking the dequantization did not help). The kernel costs ~21 us
per row against ~9-13 us per row for fp32 ``F.linear``, so the fixed cost is only repaid at ~100-130 rows: at 128
rows int8 dequant+fp32 is 1.08x faster than the kernel and int4 about even (0.96x); longer prefills favour the fp32
path more (the fixed cost is spread). In a quieter earlier run the dequantization cost half as much and the
crossovers were ~48 (int4) and ~32 (int8) rows: the thresholds are machine- and load-dependent. Compared with the
~1.6x that fp32 ``F.linear`` has over the kernels at 128 rows when a float weight is held, little is left here.

Re-measured on the quiet machine (same command), the crossovers are where the thresholds now sit::

    rows                            1     4    16    32    48    64   128
    int4 kernel (bf16 act)         82   104   357   694  1035  1370  2757
    int4 dequant + fp32 F.linear  571   671   748   905  1066  1194  1827
    int8 kernel (bf16 act)         54   102   352   710  1013  1349  2710
    int8 dequant + fp32 F.linear  234   423   544   691   829  1034  1600

The loaded-machine thresholds (128 / 96) kept a 127-token prefill on the kernel: TTFT 404 ms against 269 ms for
fp32 on SmolLM2.

With the int8 x int8 path (`python benchmarks/qlinear_paths.py`, ``OMP_NUM_THREADS=1``, best of 20: one thread is
disturbed least by the other jobs on this 2-core machine), int8 rows only::

    rows                                1     4    16    32    48    64   128   512  2048
    int8 kernel (bf16 act)             85   179   670  1333  2001  2638  5257 21371 85169
    int8 dequant + fp32 F.linear      337   457   661   952  1302  1596  2777  9811 37564
    int8 x int8 (7-bit act, 16 outl.) 846   880  1013  1198  1366  1560  2255  6580 24229
    fp32 F.linear, float weight        78   206   437   753  1011  1349  2500  9471 37214

(the int8 x int8 row before a fix of its reductions; after it, 2048 rows: 23738 us, the oneDNN call alone 19438,
outlier channels ~2100, the weight reorder ~380). It meets the dequant path at 64 rows and is 1.55x faster at 2048,
also faster than fp32 with a float weight; its fixed cost (~0.8 ms) keeps it off decode and verify batches, which
stay on the bf16 kernel (near-exact).
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F

from toolkit import cpu
from toolkit.passes import BF16_DEQUANT_MIN_ROWS, bf16_prompt_rows
from toolkit.quant import half_native, int4_native, int8_dynamic, int8_native
from toolkit.quant.code_layouts import (
    INT4PACK_BLOCK_N,
    decode_int4pack,
    group_order,
    int4_kernel_group,
    unpack_rows,
)
from toolkit.quant.kernels import (
    FAST_DTYPE,
    INT8_BF16_K_MULTIPLE,
    int4_zeros_from_zero_point,
)
from toolkit.quant.primitives import pack_int4_rows
from toolkit.quant.quantized_weight import QuantizedWeight

KERNEL_MAX_ROWS = {"int4n8": 256 if cpu.has("avx512f") else 96, "int4pack": 48, "int8pack": 32}
"""Products with fewer rows than this run the low-bit kernel; from it on, dequantize + fp32 F.linear. From the
medians in the module docstring: int4 at 128 rows 2768 (kernel) vs 2890 us, i.e. about even, so the fp32 path starts at
128; int8 at 64 rows 1365 vs 1462 us and at 128 rows 2732 vs 2541 us, crossover ~96. int4n8 (specquant's int4 GEMM,
~15 us a row for 1536x576 on AVX2, `python benchmarks/kernel_gemms.py int4`) meets the dequant path's ~1.5 ms near 96
rows there; built for an AVX512 CPU it runs ~12.5 us a row, and the dequant path (one C pass,
`int4_native.dequantize`, then fp32 F.linear) meets it between ~128 and ~512 rows depending on the bandwidth other
jobs leave (2-core EPYC, SmolLM2 up_proj, best of 20 us, two runs: 128 rows 1537-2005 vs 1528-2643, 256 rows
3058-3083 vs 2991-3630, 512 rows 6298-6321 vs 4802-6114; `python benchmarks/qlinear_paths.py`), hence 256 there.
int8pack layers on specquant's int8 GEMM keep it up to INT8_NATIVE_MAX_ROWS (set per layer). Far above the engine's
UPCAST_MIN_ROWS=4 because dequantizing is a fixed per-call cost that a float-weight layer does not pay, so decode
and verify batches always stay on the kernel. Under a bf16 prompt pass (`prefill_bf16`) the dequantize path
multiplies in bf16 and wins from BF16_DEQUANT_MIN_ROWS rows (engine/precision.py)."""

INT8_DYNAMIC_MIN_ROWS = 64
"""int8pack products with at least this many rows run int8 x int8 (`toolkit.quant.int8_dynamic`: activations
quantized per row to 7 bits, 16 outlier channels in fp32); between KERNEL_MAX_ROWS and this, dequantize + fp32.
Its fixed cost (~0.4 ms weight reorder, ~0.2 ms oneDNN call, ~0.1 ms outlier product) is repaid at ~64 rows, where
it meets the dequant path (1560 vs 1596 us); at 2048 rows it is 1.55x faster (table in the module docstring)."""

INT8_NATIVE_MAX_ROWS = 256 if cpu.has("avx512f") else INT8_DYNAMIC_MIN_ROWS
"""int8pack layers on specquant's int8 GEMM (exact: fp32 activations) run products of fewer rows than this there, and
int8 x int8 from it on. ~16 us a row on AVX2, where int8 x int8 wins from ~64 rows; ~12.7 us a row built for an
AVX512 CPU, where int8 x int8's fixed cost (~2.2 ms for 1536x576) is repaid only near 256 rows (2-core EPYC, best of
20 us: 128 rows 1610 vs 2775, 256 rows 3267 vs 3401, 512 rows 6735 vs 4242; `python benchmarks/qlinear_paths.py`)."""

_DEQUANT_BLOCK_ELEMS = 1 << 22  # dequantize at most ~4M weights (16 MB fp32) at a time
_ALIGN = 64  # the bf16 int8 kernel uses aligned loads (see kernels.py)


def int4pack_mm(x2: torch.Tensor, packed: torch.Tensor, group: int, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """torch's CPU int4 kernel on rows `x2` [rows, in], as bf16 contiguous rows (its only fast activations):
    [rows, out] in bf16. Shared by QuantLinear and the lean forward's fused int4 packs."""
    xb = x2.to(FAST_DTYPE)
    if not xb.is_contiguous():
        xb = xb.contiguous()
    return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, group, scales_and_zeros)


class QuantLinear(torch.nn.Module):
    """A Linear layer over packed low-bit weights; build it with `QuantLinear.from_quantized`."""

    native_kernels = True
    """4-bit layers run specquant's own AVX2 int4 GEMM (``"int4n8"``, `toolkit.quant.int4_native`) and int8pack layers
    its int8 GEMM (`toolkit.quant.int8_native`) where they build; False: torch's kernels (``"int4pack"``, torch's
    int8pack GEMM). Read when a layer is built (`from_quantized`); ``engine.lowbit_kernel`` sets it."""

    int8_activations = True
    """int8pack layers run products of `kernel_max_rows` rows or more int8 x int8 (activations quantized per row,
    7 bits); False: dequantize + fp32 F.linear, exact but slower. Set it with `exact_prefill`."""

    prefill_bf16 = False
    """Set on a layer by `prepare_model(..., prefill="bf16")` (engine.prefill_dtype): inside a prompt pass
    (`bf16_prefill`), a layer other than int8pack takes its dequantize path from BF16_DEQUANT_MIN_ROWS rows (or its
    `kernel_max_rows`, if lower), dequantizing to bf16 and multiplying in bf16 (fp32 accumulation), ~2x faster for
    long prompts here. int8pack layers ignore it: their exact kernel and int8 x int8 are faster."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, kernel: str):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.kernel = bits, group_size, kernel  # group_size resolved (-1 -> in)
        self.kernel_group_size = None  # int4pack: the group the kernel runs with
        self.kernel_in = in_features  # int4pack: the input width the kernel runs (a ragged last group padded)
        self.kernel_max_rows = KERNEL_MAX_ROWS.get(kernel, 0)
        self.int8_native = False  # int8pack: products below kernel_max_rows run specquant's int8 GEMM
        self._code_layout = None  # dequant path: "int4_rows", "int2_rows" or "uint8"; int4pack: "packed"/"int4_rows"
        self.bias: torch.Tensor | None
        self.register_buffer("bias", None)
        self.in_perm: torch.Tensor | None  # act-order: the input channel each held column reads (module docstring)
        self.register_buffer("in_perm", None)

    # ------------------------------------------------------------------------------------------ construction

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, device: str | torch.device = "cpu") -> "QuantLinear":
        """Pack `qw` for this machine's kernels (packed layouts are CPU-specific: never save them)."""
        device = torch.device(device)
        codes, config = qw.codes, qw.config
        if codes.dim() != 2 or codes.is_floating_point():
            raise ValueError(f"codes must be a 2-D integer tensor [out, in], got {codes.dtype} {tuple(codes.shape)}")
        out_f, in_f = codes.shape
        if qw.g_idx is None:
            gs = config.resolve_group_size(in_f)
            n_groups = config.n_groups(in_f)  # the last group ragged where gs does not divide in_f
        else:
            if tuple(qw.g_idx.shape) != (in_f,):
                raise ValueError(f"g_idx must have shape ({in_f},), got {tuple(qw.g_idx.shape)}")
            gs = config.group_size if config.group_size != -1 else in_f
            n_groups = int(qw.g_idx.max()) + 1 if in_f else 0
        if tuple(qw.scale.shape) != (out_f, n_groups) or tuple(qw.zero.shape) != (out_f, n_groups):
            raise ValueError(f"scale and zero must be [{out_f}, {n_groups}], got {tuple(qw.scale.shape)} and "
                             f"{tuple(qw.zero.shape)}")
        if qw.zero.is_floating_point():
            raise ValueError(f"zero must be an integer tensor, got {qw.zero.dtype}")
        codes = codes.to(device=device, dtype=torch.uint8)
        scale = qw.scale.to(device=device, dtype=torch.float32)
        zero = qw.zero.to(device=device)
        trivial_g_idx = qw.g_idx is None or torch.equal(
            qw.g_idx.long().cpu(), torch.arange(in_f) // gs)
        in_perm = None
        if not trivial_g_idx and device.type == "cpu":
            in_perm = group_order(qw.g_idx, gs)
            if in_perm is not None:  # act-order: columns sorted by group, the inputs gathered to match per product
                codes, trivial_g_idx = codes[:, in_perm.long()].contiguous(), True

        kernel = "dequant"
        if device.type == "cpu" and trivial_g_idx:
            if (config.bits == 8 and config.symmetric and n_groups == 1 and in_f % INT8_BF16_K_MULTIPLE == 0
                    and bool((zero == 128).all())):
                kernel = "int8pack"
            elif (config.bits == 4 and cls.native_kernels and int4_native.supports(out_f, in_f, gs)
                  and bool(((zero >= 0) & (zero <= 255)).all()) and int4_native.available()):
                kernel = "int4n8"
            elif config.bits == 4 and int4_kernel_group(out_f, n_groups * gs, gs) is not None:
                kernel = "int4pack"
        self = cls(in_f, out_f, config.bits, gs, kernel)
        if in_perm is not None:
            self.in_perm = in_perm.to(device)
        if qw.bias is not None:
            self.bias = qw.bias.detach().to(device=device, dtype=torch.float32).clone()

        if kernel == "int8pack":
            w8 = (codes.to(torch.int16) - 128).to(torch.int8).contiguous()
            s = scale.reshape(out_f)
            self.int8_native = cls.native_kernels and int8_native.supports(out_f, in_f) and int8_native.available()
            if self.int8_native:  # up to where the int8 x int8 prefill path takes over (INT8_NATIVE_MAX_ROWS)
                self.kernel_max_rows = INT8_NATIVE_MAX_ROWS
                self.register_buffer("weight_int8_h16", int8_native.pack(w8))  # the only copy of the codes
            else:
                self.register_buffer("weight_int8", w8.clone())  # fresh: 64-byte aligned
                self.register_buffer("scale_bf16", s.to(FAST_DTYPE).contiguous())  # torch's kernel's (bf16) scales
            self.register_buffer("scale", s.contiguous())  # exact, for the fp32 path and specquant's int8 GEMM
        elif kernel == "int4n8":
            n8_codes, n8_scale, n8_zero = int4_native.pack(codes, scale, zero, gs)
            self.register_buffer("weight_int4n8", n8_codes)  # [out/8, in/2, 8]
            self.register_buffer("scale", n8_scale)  # [out/8, n_groups, 8] fp32, exact
            self.register_buffer("zero", n8_zero)  # [out/8, n_groups, 8] uint8
            self._code_layout = "n8"
        elif kernel == "int4pack":
            # a ragged last group (SmolLM2's 576 at g128) runs zero-padded to a whole one: the padded codes multiply
            # the zeros appended to x, so any code will do (the kernel needs in % group == 0)
            self.kernel_in = n_groups * gs  # in_f, or in_f padded to whole groups (g_idx is trivial here)
            codes = F.pad(codes, (0, self.kernel_in - in_f))
            kg = int4_kernel_group(out_f, self.kernel_in, gs)
            self.kernel_group_size = kg
            rep = gs // kg  # per-channel weights: the kernel runs a smaller group with the scales repeated
            ks = scale.repeat_interleave(rep, dim=1)
            kz = int4_zeros_from_zero_point(ks, zero.repeat_interleave(rep, dim=1))
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
            sz = torch.stack([ks, kz], dim=-1).transpose(0, 1).to(FAST_DTYPE).contiguous()
            self.register_buffer("weight_int4pack", packed)
            self.register_buffer("scales_and_zeros", sz)  # [in/kg, out, 2] bf16
            self._register_exact_qparams(scale, zero, transposed=True)
            if torch.equal(decode_int4pack(packed, out_f, self.kernel_in, 0, out_f), codes.t()):
                self._code_layout = "packed"  # the fp32 path reads the kernel's own bytes
            else:  # an unknown packed layout (e.g. AVX512's): keep a portable copy for the fp32 path
                self._code_layout = "int4_rows"
                self.register_buffer("codes", pack_int4_rows(codes))
        else:
            if config.bits == 4 and in_f % 2 == 0:
                self._code_layout, stored = "int4_rows", pack_int4_rows(codes)
            elif config.bits == 2 and in_f % 4 == 0:
                q = codes.view(out_f, in_f // 4, 4)
                self._code_layout, stored = "int2_rows", q[..., 0] | q[..., 1] << 2 | q[..., 2] << 4 | q[..., 3] << 6
            else:
                self._code_layout, stored = "uint8", codes
            self.register_buffer("codes", stored.contiguous().clone())
            self._register_exact_qparams(scale, zero, transposed=False)
            if not trivial_g_idx:
                self.register_buffer("g_idx", qw.g_idx.to(device=device, dtype=torch.int32).clone())
            elif in_f % gs:  # a ragged last group: each column's group, as act-order weights keep theirs
                self.register_buffer("g_idx", (torch.arange(in_f, device=device) // gs).to(torch.int32))
        return self

    def _register_exact_qparams(self, scale: torch.Tensor, zero: torch.Tensor, transposed: bool) -> None:
        # zero points fit a byte (bits <= 8); they are widened to fp32 per call (n_groups x out values: negligible)
        z = zero.to(torch.uint8) if bool(((zero >= 0) & (zero <= 255)).all()) else zero.to(torch.int32)
        if transposed:  # [n_groups, out]: the int4pack fp32 path builds W.T [in, out]
            scale, z = scale.t(), z.t()
        self.register_buffer("scale", scale.contiguous().clone())
        self.register_buffer("zero", z.contiguous().clone())

    # -------------------------------------------------------------------------------------------- forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_perm is not None:
            x = x.index_select(-1, self.in_perm)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        y = None
        # int8 layers keep their own prompt paths (exact kernel, then int8 x int8) in a bf16 prompt pass too
        bf16 = (self.prefill_bf16 and self.kernel != "int8pack" and bf16_prompt_rows(rows)
                and x.dtype == torch.float32)
        limit = min(self.kernel_max_rows, BF16_DEQUANT_MIN_ROWS) if bf16 else self.kernel_max_rows
        if 0 < rows < limit:
            y = self._kernel(x.reshape(rows, self.in_features))
            y = y.to(x.dtype)
            if self._native:
                return y.reshape(*x.shape[:-1], self.out_features)
        elif rows >= INT8_DYNAMIC_MIN_ROWS and self._runs_int8_dynamic(x):
            y = int8_dynamic.linear(x.reshape(rows, self.in_features).float().contiguous(), self.int8_rows(),
                                    self.scale, torch.zeros(self.out_features, dtype=torch.int32),
                                    int8_dynamic.outlier_channels(self.in_features))
            y = None if y is None else y.to(x.dtype)  # None: x holds inf/nan, left to the exact path
        if y is None:
            compute = (torch.bfloat16 if bf16 else x.dtype if cpu.native_matmul(x.dtype, x.device)
                       else torch.float32)
            x2 = x.reshape(rows, self.in_features).to(compute)
            fresh = x2.requires_grad and torch.is_grad_enabled()  # autograd would keep the scratch buffer
            y = torch.cat([F.linear(x2, self._weight_block(n0, n1, compute, fresh))
                           for n0, n1 in self._blocks()], dim=-1) if rows else x2.new_zeros(0, self.out_features)
            y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    @property
    def _native(self) -> bool:
        """Whether the kernel path runs one of specquant's own GEMMs (fp32, bias inside) rather than torch's."""
        return self.kernel == "int4n8" or self.int8_native

    def _runs_int8_dynamic(self, x: torch.Tensor) -> bool:
        """int8pack prefill: int8 x int8 with per-call activation quantization (`toolkit.quant.int8_dynamic`),
        unless switched off (`exact_prefill`), autograd needs the input, or this torch lacks the oneDNN ops."""
        return (self.kernel == "int8pack" and QuantLinear.int8_activations and x.device.type == "cpu"
                and not (x.requires_grad and torch.is_grad_enabled()) and int8_dynamic.available())

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        if self._native:  # fp32 activations, the bias added in the kernel (forward adds none after)
            if self.kernel == "int4n8":
                return int4_native.linear(x2, self.weight_int4n8, self.scale, self.zero, self.group_size, self.bias)
            return int8_native.linear(x2, self.weight_int8_h16, self.scale, self.bias)
        xb = x2.to(FAST_DTYPE)
        if not xb.is_contiguous():
            xb = xb.contiguous()
        if self.kernel == "int8pack":
            if xb.data_ptr() % _ALIGN:
                xb = xb.clone()
            return torch.ops.aten._weight_int8pack_mm(xb, self.weight_int8, self.scale_bf16)
        if self.kernel_in != self.in_features:
            xb = F.pad(xb, (0, self.kernel_in - self.in_features))
        return int4pack_mm(xb, self.weight_int4pack, self.kernel_group_size, self.scales_and_zeros)

    def _blocks(self) -> list[tuple[int, int]]:
        """Output-row ranges to dequantize one at a time (int4pack: aligned to its 32-row blocks)."""
        n, k = self.out_features, self.in_features
        step = max(1, _DEQUANT_BLOCK_ELEMS // max(k, 1))
        if self.kernel == "int4n8":  # whole 8-row blocks of its layout
            step = max(int4_native.BLOCK_N, step // int4_native.BLOCK_N * int4_native.BLOCK_N)
        if self.kernel == "int4pack":
            step = max(INT4PACK_BLOCK_N, step // INT4PACK_BLOCK_N * INT4PACK_BLOCK_N)
        if self.int8_native:  # whole tiles of the h16 order (`int8_rows`)
            tile = int8_native.N_MULTIPLE * half_native.TILE
            step = max(tile, step // tile * tile)
        bounds = list(range(0, n, step)) + [n]
        if self.kernel == "int4pack" and len(bounds) > 2 and bounds[-1] - bounds[-2] < INT4PACK_BLOCK_N:
            del bounds[-2]  # the packed tail (< 32 rows) is decoded with the block before it
        return list(zip(bounds[:-1], bounds[1:]))

    def _weight_block(self, n0: int, n1: int, dtype: torch.dtype, fresh: bool = False) -> torch.Tensor:
        """Rows n0:n1 of the float weight, ``(q - zero) * scale`` in fp32, as [n1-n0, in] (maybe a transposed view).

        Written into a per-thread scratch buffer that the next call overwrites: a fresh multi-MB tensor per call
        would be page-faulted in by the OS each time, which here costs more than the dequantization itself
        (~0.5 ms for 1536x576). The scratch is at most ~16 MB per thread, shared by all layers."""
        k, gs, n = self.in_features, self.group_size, n1 - n0
        size = n * self.kernel_in  # n * k, or more for int4pack with a ragged last group (decoded padded)
        buf = (torch.empty(size, device=self.scale.device) if fresh else _scratch(size, self.scale.device))
        if self.kernel == "int8pack":
            w = torch.mul(self.int8_rows(n0, n1), self.scale[n0:n1, None], out=buf.view(n, k))
        elif self.kernel == "int4n8":
            # one C pass (the kernel is built wherever a layer runs int4n8), into bf16 directly when asked for it
            b0, b1 = n0 // int4_native.BLOCK_N, n1 // int4_native.BLOCK_N
            out = buf.view(torch.bfloat16)[:n * k].view(n, k) if dtype == torch.bfloat16 else buf.view(n, k)
            w = int4_native.dequantize(self.weight_int4n8, self.scale, self.zero, self.group_size, b0, b1, out)
        elif self.kernel == "int4pack":  # built as W.T [in, n] so the packed layout is read in order
            kp = self.kernel_in  # in, or in padded to a whole last group
            wt = buf.view(kp, n)
            if self._code_layout == "packed":
                decode_int4pack(self.weight_int4pack, self.out_features, kp, n0, n1, out=wt)
            else:
                wt.copy_(unpack_rows(self.codes[n0:n1], "int4_rows", kp).t())
            g = wt.view(kp // gs, gs, n)
            g.sub_(self.zero[:, n0:n1].float()[:, None]).mul_(self.scale[:, None, n0:n1])
            w = wt[:k].t()
        else:
            w = unpack_rows(self.codes[n0:n1], self._code_layout, k, out=buf.view(n, k))
            if hasattr(self, "g_idx"):  # act-order, or a ragged last group: each column's group
                gi = self.g_idx.long()
                w.sub_(self.zero[n0:n1].float()[:, gi]).mul_(self.scale[n0:n1][:, gi])
            else:
                w.view(n, k // gs, gs).sub_(self.zero[n0:n1].float()[:, :, None]).mul_(self.scale[n0:n1, :, None])
        return w if dtype == torch.float32 else w.to(dtype)

    def int8_rows(self, n0: int = 0, n1: int | None = None) -> torch.Tensor:
        """An int8pack layer's codes ``q - 128`` of output channels n0:n1 as int8 [n1 - n0, in]: a view where torch's
        kernel runs ([out, in] held), a fresh copy on specquant's int8 GEMM (the h16 order held; n0 and n1 on its
        64-row tiles, n1 may be out_features)."""
        n1 = self.out_features if n1 is None else n1
        if self.int8_native:
            return int8_native.rows(self.weight_int8_h16, self.out_features, self.in_features, n0, n1)
        return self.weight_int8[n0:n1]

    def dequantized_weight(self) -> torch.Tensor:
        """The float weight [out, in] the codes stand for, ``(q - zero) * scale`` in fp32, in a fresh tensor (for
        re-quantizing a checkpoint's layers, e.g. a self-draft at fewer bits; not a runtime path); columns in the
        inputs' own order (an act-order layer's held columns put back)."""
        w = torch.cat([self._weight_block(n0, n1, torch.float32, fresh=True) for n0, n1 in self._blocks()])
        if self.in_perm is not None:
            w = w[:, torch.argsort(self.in_perm.long())]
        return w

    # ----------------------------------------------------------------------------------------- reporting

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer this module holds: packed weights, scales/zeros (all copies), bias. Not counted:
        per-call temporaries (the int8 prefill path's reordered weight copy, ~1 byte per weight, lives for one
        product only, like the dequant path's fp32 scratch)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        group = "per-channel" if self.group_size == self.in_features else self.group_size
        s = (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
             f"group_size={group}, kernel={self.kernel}")
        if self.kernel_group_size is not None and self.kernel_group_size != self.group_size:
            s += f" (group {self.kernel_group_size})"
        if self.int8_native:
            s += " (specquant int8 GEMM)"
        if self.in_perm is not None:
            s += ", act-order (inputs gathered by group)"
        return s + f", bias={self.bias is not None}"


def int4_kernel() -> str:
    """The kernel 4-bit layers whose shape both kernels take get here: "int4n8" (specquant's own) or "int4pack"."""
    return "int4n8" if QuantLinear.native_kernels and int4_native.available() else "int4pack"


@contextlib.contextmanager
def exact_prefill():
    """Within the block, int8pack layers run many-row products on the exact dequantize + fp32 path (no activation
    quantization): for quality baselines, or when the int8 x int8 path's error matters more than its speed."""
    previous, QuantLinear.int8_activations = QuantLinear.int8_activations, False
    try:
        yield
    finally:
        QuantLinear.int8_activations = previous


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's weights: every QuantLinear's `nbytes` plus every remaining parameter, each storage once
    (tied parameters, e.g. an embedding shared with the output head, count once)."""
    total, seen = 0, set()
    for module in model.modules():
        if isinstance(module, QuantLinear):
            total += module.nbytes
    for p in model.parameters():  # QuantLinear holds buffers only, so nothing is counted twice
        key = (p.device, p.data_ptr(), p.numel(), p.dtype)
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    return total


# ------------------------------------------------------------------------------- the dequant path's scratch buffer


_SCRATCH = threading.local()


def _scratch(numel: int, device: torch.device) -> torch.Tensor:
    """A flat fp32 buffer of `numel` values, reused across calls and layers (one per thread and device)."""
    key = str(device)
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = {}
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        # a normal tensor even when first asked for under inference_mode: an inference tensor could not be
        # written outside it (the dequant path runs both ways)
        with torch.inference_mode(False):
            buf = bufs[key] = torch.empty(numel, dtype=torch.float32, device=device)
    return buf[:numel]
