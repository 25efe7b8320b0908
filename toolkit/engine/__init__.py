"""The generation engine: prefill and decode_step over a preallocated KV cache, sampling, timing."""

from toolkit.engine.generate import (
    GenerationResult,
    SequenceOutput,
    decode_step,
    generate,
    prefill,
)
from toolkit.engine.sampling import SamplingParams
from toolkit.kv.contiguous import ContiguousKVCache

__all__ = [
    "ContiguousKVCache",
    "GenerationResult",
    "SamplingParams",
    "SequenceOutput",
    "decode_step",
    "generate",
    "prefill",
]
