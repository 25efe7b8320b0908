"""Which kind of forward pass is running, for the layers whose arithmetic depends on it (docs/engine.md).

The engine sets it around a pass (`bf16_prefill` around a prompt, `exact_linears` around an overflow rerun);
HalfStorageLinear (toolkit/engine/precision.py) and QuantLinear (toolkit/quant/qlinear.py) read it on their hot
path, so it is two class attributes rather than a lookup. It sits below both so that neither imports the other.
"""

import contextlib


class Pass:
    exact = False  # inside exact_linears(): fp16-stored layers compute in the activations' dtype, never in fp16
    prefill = False  # inside bf16_prefill(): a prompt pass is running


# engine.prefill_dtype=bf16 (auto on CPUs with AVX512-BF16/AMX): inside `bf16_prefill()`, products of at least this
# many rows on fp16-stored layers run in bf16 (bf16 copies of the weights, fp32 accumulation and output). A prompt's
# products are compute-bound, and oneDNN's bf16 GEMM runs them ~2.2x faster than fp32 or fbgemm's fp16 here
# (SmolLM2's 1536x576 layer at 128 rows: 0.56 ms against 1.28 / 1.09 ms on a 2-core EPYC with AVX512-BF16). Decode
# steps and speculative verify passes never run it (the context is entered around the prompt pass only), so their
# arithmetic, and greedy speculation's identity with the target alone, stay as they were.
BF16_PREFILL_MIN_ROWS = 16
# ... and 4-bit QuantLinear layers (and their fused packs) from this many rows of such a pass leave their int4 kernel
# for dequantize-to-bf16 + bf16 F.linear (2-core EPYC, SmolLM2 1536x576 g64, median ms, kernel vs bf16 path; noisy:
# 64 rows 0.79-1.29 vs 0.99-1.25, 96 rows 1.22-1.87 vs 1.11-1.36, 128 rows 1.58-1.88 vs 1.28; `python
# benchmarks/qlinear_paths.py` prints the table for this machine).
BF16_DEQUANT_MIN_ROWS = 96


def bf16_prompt_rows(rows: int) -> bool:
    """Whether a product of `rows` rows runs in bf16 now: inside `bf16_prefill()`, outside `exact_linears()`, and at
    least BF16_PREFILL_MIN_ROWS rows (layers opt in by holding a bf16 weight or QuantLinear's `prefill_bf16`)."""
    return Pass.prefill and not Pass.exact and rows >= BF16_PREFILL_MIN_ROWS


@contextlib.contextmanager
def exact_linears():
    """Within the block, HalfStorageLinear computes in the activations' dtype (fp32 on CPU), never in fp16."""
    previous, Pass.exact = Pass.exact, True
    try:
        yield
    finally:
        Pass.exact = previous


@contextlib.contextmanager
def bf16_prefill():
    """Within the block (a prompt pass), layers prepared with `prefill="bf16"` run many-row products in bf16 (see
    BF16_PREFILL_MIN_ROWS); every other layer, and every call outside the block, is unchanged."""
    previous, Pass.prefill = Pass.prefill, True
    try:
        yield
    finally:
        Pass.prefill = previous
