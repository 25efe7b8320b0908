"""llama.cpp as a bench baseline (`specquant bench baseline=llamacpp`): the engine users would otherwise pick, run
in the same process on the same prompt token ids with the same threads, interleaved with specquant's runs
(docs/benchmarks.md, "llama.cpp beside specquant").

llama-cpp-python is an optional extra built from source (`pip install -e ".[llamacpp]"` with
`CMAKE_ARGS="-DGGML_NATIVE=ON"`); where it is missing, the result says so instead of a row.

Which weights it runs: the engine's own. The benchmarked model (a specquant checkpoint, or the float model) is
exported once with `specquant export format=gguf`'s code (`toolkit.quant.formats.gguf_export`, type auto: the
checkpoint's grid as Q4_0 / Q4_1 / Q8_0 blocks, a float model as F16) into the cache folder below, keyed by the
checkpoint's content hash; the row says "same weights" when every quantized tensor kept its grid (fp16 block
constants aside) and "nearest type, requantized" where some grid has no llama.cpp block type.

Fallback, where that export cannot be made (a GPTQ/AWQ directory, an architecture it does not write): the registry
model's own GGUF requantized by llama.cpp to the type nearest the engine's weights -- F16 for a float model, Q8_0
for an 8-bit checkpoint, Q4_0 for a 4-bit one -- with `allow_requantize`. The shipped GGUFs are already 4-bit
(SmolLM2's Q4_1), so those are not the engine's weights; the row says "registry GGUF, requantized".
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from toolkit.bench.baseline import float_source
from toolkit.errors import InputError, ModelError
from toolkit.models.cache import SOURCE_GGUF
from toolkit.paths import home, models_dir
from toolkit.quant.checkpoint import MANIFEST, is_quantized_checkpoint, read_manifest
from toolkit.quant.formats import ExportError, is_quantized_model
from toolkit.quant.formats.gguf_export import EXPORT_VERSION, export_gguf
from toolkit.timing import GenerationTiming, Stopwatch

TYPES = ("F16", "Q8_0", "Q4_0")
FALLBACK = "registry GGUF, requantized"
# llama.cpp's KV cache type beside each of ours (its `type_k` / `type_v`): the same bits; it has no 2-bit type
KV_TYPES = {"fp": "f16", "int8": "q8_0", "int4": "q4_0", "int2": "q4_0"}
# bytes an element of each KV type takes: blocks of 32 with an fp16 scale
KV_TYPE_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


def kv_type(kind: str) -> str:
    """llama.cpp's KV cache type for our `kv` kind (KVSpec.kind): the same bits (q4_0 for int2: the nearest)."""
    return KV_TYPES[kind]


def unavailable() -> str | None:
    """Why llama.cpp cannot run here, or None."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return ('llama-cpp-python is not installed (an optional source build: CMAKE_ARGS="-DGGML_NATIVE=ON" '
                'pip install -e ".[llamacpp]")')
    return None


def checkpoint_bits(model_name: str) -> int | None:
    """The weight bits of a quantized checkpoint (None: a float model), for llama.cpp's nearest type."""
    if not is_quantized_model(model_name):
        return None
    return int(read_manifest(model_name)["recipe"]["bits"]) if is_quantized_checkpoint(model_name) else 4


def nearest_type(bits: int | None) -> str:
    """llama.cpp's type for weights of `bits` bits (None: a float model)."""
    return {None: "F16", 8: "Q8_0", 4: "Q4_0"}.get(bits, "Q4_0" if bits and bits < 8 else "F16")


def source_gguf(model_name: str) -> Path:
    """The GGUF a registry model was converted from (`specquant models fetch` keeps it in the cache entry)."""

    path = models_dir() / model_name / SOURCE_GGUF
    if not path.is_file():
        raise InputError(f"no GGUF for {model_name} in the model cache ({path})",
                         f"run `specquant models fetch {model_name}` (llama.cpp runs the registry's GGUF models)")
    return path


def gguf_of_type(model_name: str, gguf_type: str) -> Path:
    """`model_name`'s GGUF requantized to `gguf_type` by llama.cpp (made once, cached, written aside and renamed)."""
    import ctypes

    import llama_cpp

    if gguf_type not in TYPES:
        raise InputError(f"unknown llama.cpp type {gguf_type!r}", f"use one of {', '.join(TYPES)}")
    target = home() / "llamacpp" / f"{model_name}-{gguf_type}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{gguf_type}")
    params.allow_requantize = True
    params.pure = gguf_type != "Q4_0"  # every tensor in the type (Q4_0 keeps llama.cpp's own mix for the head)
    partial = target.with_suffix(f".{os.getpid()}.part")
    rc = llama_cpp.llama_model_quantize(str(source_gguf(model_name)).encode(), str(partial).encode(),
                                        ctypes.byref(params))
    if rc != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not requantize {model_name} to {gguf_type} (rc {rc})")
    os.replace(partial, target)
    return target


def content_key(model_name: str) -> str:
    """A hash of what the model's weights are: its manifest (checkpoint or model-cache entry, which list every
    file's xxh3), else every file's name, size and mtime; with the GGUF export's version."""
    import xxhash

    path = Path(model_name).expanduser()
    if not path.is_dir():
        path = models_dir() / model_name
    digest = xxhash.xxh3_64(f"gguf-export-{EXPORT_VERSION}".encode())
    manifests = [path / MANIFEST, path / "manifest.json"]
    manifest = next((m for m in manifests if m.is_file()), None)
    if manifest is not None:
        digest.update(manifest.read_bytes())
    elif path.is_dir():
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            st = f.stat()
            digest.update(f"{f.relative_to(path)}:{st.st_size}:{st.st_mtime_ns}".encode())
    else:
        raise InputError(f"{model_name} is neither a directory nor a cached registry model",
                         f"run `specquant models fetch {model_name}`")
    return digest.hexdigest()


def exported_gguf(model_name: str) -> tuple[Path, dict]:
    """``(path, export record)`` of the model's own weights as GGUF (`toolkit.quant.formats.gguf_export`, type
    auto), made once and cached under the content hash; the record says "same weights" or which tensors were
    requantized."""

    stem = Path(str(model_name).rstrip("/")).name
    target = home() / "llamacpp" / f"{stem}-export-{content_key(model_name)}.gguf"
    record_path = target.with_suffix(".json")
    if target.is_file() and record_path.is_file():
        return target, json.loads(record_path.read_text())
    record = export_gguf(model_name, target, "auto", force=True).to_dict()
    partial = record_path.with_suffix(f".{os.getpid()}.part")
    partial.write_text(json.dumps(record, indent=1))
    os.replace(partial, record_path)
    return target, record


def peer_for(model_name: str, bits: int | None, n_ctx: int, threads: int, kv: str = "f16") -> LlamaCpp:
    """llama.cpp on the benchmarked model's own weights (`exported_gguf`), or where that export cannot be made,
    on the registry GGUF requantized to the nearest type (the row's ``weights`` says which); its KV cache of type
    `kv` (`kv_type`: the bits of the engine's)."""

    try:
        path, record = exported_gguf(model_name)
        return LlamaCpp(path, record["type"], n_ctx, threads, weights=record["weights"], kv=kv)
    except (ExportError, InputError, ModelError) as exc:

        gguf_type = nearest_type(bits)
        peer = LlamaCpp(gguf_of_type(float_source(model_name), gguf_type), gguf_type, n_ctx, threads,
                        weights=FALLBACK, kv=kv)
        peer.fallback_reason = str(exc)
        return peer


class LlamaCpp:
    """One llama.cpp model, run greedily on token ids: `run(ids, new_tokens) -> (tokens, timing)` with the same
    TTFT / ITL marks as the engine's runs (first token after the prompt's evaluation, then one per step)."""

    def __init__(self, path: Path, gguf_type: str, n_ctx: int, threads: int, weights: str = FALLBACK,
                 kv: str = "f16"):
        import llama_cpp

        self.path, self.gguf_type, self.weights, self.kv_type = path, gguf_type, weights, kv
        self.fallback_reason: str | None = None
        kv_code = getattr(llama_cpp, f"GGML_TYPE_{kv.upper()}")  # a quantized KV cache needs flash attention
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   n_batch=min(n_ctx, 2048), flash_attn=True, type_k=kv_code, type_v=kv_code,
                                   verbose=False)

    def run(self, ids: list[int], new_tokens: int) -> tuple[list[int], GenerationTiming]:
        # llama-cpp-python's generate() keeps the longest prefix its context already holds (a repeated prompt would
        # skip its prefill); the engine prefills every prompt in full, so llama.cpp does too
        self.llm.reset()
        watch, tokens = Stopwatch(), []
        for token in self.llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            watch.mark()
            tokens.append(int(token))
            if len(tokens) == new_tokens:
                break
        return tokens, watch.timing(len(ids), 1)

    def weight_bytes(self) -> int:
        """Bytes a decode step reads, as for the engine: the file's tensors (a close upper bound)."""
        return self.path.stat().st_size

    def kv_bytes_per_element(self) -> float:
        return KV_TYPE_BYTES[self.kv_type]

    def describe(self) -> str:
        return f"llama.cpp {self.gguf_type}, {self.weights}" + (f", KV {self.kv_type}" if self.kv_type != "f16" else "")
