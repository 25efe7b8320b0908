"""Turn an `engine` config into a ready model: threads set, weights loaded and cast for the engine."""

import dataclasses
import logging
import os
from pathlib import Path

import torch

from toolkit.engine.lean_forward import LeanForward
from toolkit.engine.lean_forward import install as install_forward
from toolkit.engine.precision import Precision, prepare_model, resolve_precision
from toolkit.engine.spec import ENGINE_DOTS, LOWBIT_KERNELS, EngineSpec
from toolkit.errors import InputError, ModelError
from toolkit.model_state import state_of
from toolkit.models import load_model
from toolkit.models.load import LoadedModel
from toolkit.quant.checkpoint import (
    is_quantized_checkpoint,
    load_quantized,
    peer_record,
    read_manifest,
)
from toolkit.quant.formats import (
    detect_format,
    export_source,
    import_checkpoint,
    is_quantized_model,
)
from toolkit.quant.model_quant import swap_quantized_modules
from toolkit.quant.qlinear import QuantLinear

log = logging.getLogger(__name__)


def configure_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (None = all cores); returns the count in force."""
    count = threads or os.cpu_count() or 1
    if count < 1:
        raise InputError(f"engine.threads must be >= 1, got {threads}", "use null for all cores")
    torch.set_num_threads(count)
    return count


def configure_engine(engine: EngineSpec) -> int:
    """The process-wide engine settings, before any model is loaded: threads (returned) and the low-bit kernels."""
    engine = _spec(engine)
    choose_lowbit_kernels(engine.lowbit_kernel)
    return configure_threads(engine.threads)


def _spec(engine) -> EngineSpec:
    if not isinstance(engine, EngineSpec):
        raise TypeError(f"the engine settings are an EngineSpec, got {type(engine).__name__}: resolve a config node "
                        "once with EngineSpec.from_node (the CLI does)")
    return engine


def choose_lowbit_kernels(choice: str) -> None:
    """Which GEMMs the low-bit QuantLinear layers built from now on run (a quantized checkpoint's, the self-draft's):
    auto / specquant = specquant's AVX2 int4 and int8 GEMMs where they build (toolkit/quant/int4_native.py,
    int8_native.py; fp32 activations), torch = torch's int4 / int8 CPU kernels (bf16 activations)."""

    if choice not in LOWBIT_KERNELS:
        raise InputError(f"engine.lowbit_kernel={choice!r} is not one of {', '.join(LOWBIT_KERNELS)}",
                         "use engine.lowbit_kernel=auto")
    QuantLinear.native_kernels = choice != "torch"


DEFAULT_ENGINE_YAML = Path(__file__).resolve().parents[1] / "conf" / "engine" / "default.yaml"


def default_engine_config(**overrides) -> EngineSpec:
    """The engine settings the CLI runs with (``conf/engine/default.yaml``), ``overrides`` merged over them: what
    the benches that load models outside a hydra command start from."""
    from omegaconf import OmegaConf

    yaml = OmegaConf.load(DEFAULT_ENGINE_YAML)
    yaml.pop("defaults", None)  # hydra's defaults list (the engine/schema it extends), not a setting
    return EngineSpec.from_node(OmegaConf.merge(yaml, overrides))


def load_engine_model(name: str, engine: EngineSpec):
    """Load `name` (registry name, directory, hub id) and prepare it for the engine; returns a LoadedModel whose
    `precision` says what it runs in."""

    configure_engine(engine)
    loaded = load_quantized_model(name) if is_quantized_model(name) else load_model(name, dtype=torch.float32)
    loaded.precision = prepare_engine_model(loaded.model, engine)
    return loaded


def load_quantized_model(path):
    """A checkpoint written by `specquant quantize` (or a GPTQ/AWQ-format directory, imported by
    `toolkit.quant.formats`), with its Linear layers swapped for QuantLinear (packed low-bit weights, run by
    low-bit kernels); the remaining float parameters are fp32 until prepared."""
    import time
    from pathlib import Path

    start = time.perf_counter()
    ours = is_quantized_checkpoint(path)
    model, qsd, tokenizer = (load_quantized if ours else import_checkpoint)(path, dtype=torch.float32)
    if tokenizer is None:
        raise ModelError(f"quantized checkpoint {path} has no tokenizer", "re-run specquant quantize, which saves one")
    swap_quantized_modules(model, qsd, QuantLinear.from_quantized)
    recipe = qsd.recipe
    group = "per-channel" if recipe.group_size == -1 else f"g{recipe.group_size}"
    peer = peer_record(path) if ours else None
    method = f"{peer.get('tool')} {peer.get('method')}" if peer else recipe.method
    label = f"{method} int{recipe.bits} {group}" + ("" if ours else f" ({detect_format(path)} format)")
    state_of(model).quant_label = label  # shown beside the dtype in results
    source = read_manifest(path).get("source") if ours else export_source(path)
    name = f"{source or Path(path).name} ({Path(path).name})"
    return LoadedModel(model, tokenizer, name, None, Path(path), torch.float32,
                       time.perf_counter() - start)


def use_native_dot(model, dot: str) -> None:
    """engine.native_dot: fp32 (default) keeps a float model's native stack on fp16 weights x fp32 activations and an
    int4 model's on the exact fp32 int4 kernel; bf16 puts a float model's products and output head on the bf16
    dot-product kernel (`toolkit.quant.bf16_native`); int8 runs an int4 model's products with each row's activations
    rounded to int8 per weight group, on integer dot products (`toolkit.quant.vnni`, llama.cpp's q8 activations).
    A model whose stack runs other layers keeps its own kernels and its fp32 setting where that is harmless (a bf16
    setting on a low-bit draft); a model the native stack cannot run at all is an error."""

    if dot not in ENGINE_DOTS:
        raise InputError(f"unknown engine.native_dot {dot!r}", f"use one of {', '.join(ENGINE_DOTS)}")
    if dot == "fp32":
        return
    forward = model.__dict__.get("forward")
    if not isinstance(forward, LeanForward) or not forward.native:
        raise InputError(f"engine.native_dot={dot} needs the native decoder stack, which this model does not run",
                         "use engine.forward=auto or native, or engine.native_dot=fp32")
    native = forward.native_decoder()
    if dot == "int8":
        _use_int8_activations(forward, native)
    elif native is not None and native.half == 0:
        log.info("engine.native_dot=bf16: this model's native stack runs low-bit layers, which keep their kernels")
        return
    else:
        forward.use_dot(dot)
        if forward.native_decoder() is None:
            why = forward.native_reason
            forward.use_dot("fp32")
            raise InputError(f"engine.native_dot=bf16 cannot run this model: {why}",
                             "use engine.native_dot=fp32, or a CPU with AVX512-BF16")
    state = state_of(model)
    state.precision = dataclasses.replace(state.precision, dot=dot)


def _use_int8_activations(forward, native) -> None:
    """engine.native_dot=int8: every product of the stack on int8 activations (int4 checkpoints: the w4a8 kernel;
    int8 checkpoints: w8a8), or an error naming why not."""
    fix = "use engine.native_dot=fp32 (exact fp32 activations)"
    if native is None:
        raise InputError(f"engine.native_dot=int8 needs the native decoder stack: {forward.native_reason}", fix)
    if native.half:
        raise InputError("engine.native_dot=int8 applies to int4 and int8 checkpoints; this is a float model",
                         f"quantize it first (specquant quantize recipe=.../rtn-w4g64), or {fix}")
    forward.use_activations("int8")
    native = forward.native_decoder()
    products = len(native.kinds) if native is not None else 0
    if native is None or native.w4a8 != products:
        forward.use_activations("fp32")
        raise InputError("engine.native_dot=int8 cannot run every product of this model with int8 activations "
                         "(its layers must all be int4, on AVX2 or better, or all int8 per channel, on AVX512-VNNI; "
                         "each width a multiple of 16 with a group of a multiple of 8, an int8 layer's input width "
                         "a multiple of 32)", fix)


def prepare_engine_model(model, engine: EngineSpec) -> Precision:
    """Move and cast `model` (in place) as the engine settings say; returns its precision."""
    engine = _spec(engine)
    if engine.device != "cpu" and not torch.cuda.is_available():
        raise InputError(f"engine.device={engine.device} but no CUDA device is available", "use engine.device=cpu")
    precision = resolve_precision(engine.dtype, engine.weight_dtype, engine.device)
    if engine.device != "cpu":
        model.to(engine.device)
    prepare_model(model, precision, wide_copy=engine.wide_copy, gemm=engine.gemm, prefill=engine.prefill_dtype)
    state_of(model).forward = install_forward(model, engine.forward)
    use_native_dot(model, engine.native_dot)
    if engine.compile:
        compile_decode(model)
    return state_of(model).precision  # with what the prompt passes resolved to


def compile_decode(model) -> None:
    """torch.compile the forward that decode steps use (prefill stays eager: one graph fewer to build), with
    dynamic shapes so one graph serves every cache length. The first decode step pays the compilation."""
    state_of(model).decode_forward = torch.compile(model.forward, dynamic=True)
