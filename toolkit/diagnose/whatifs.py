"""Section 5, what-ifs: the knobs the diagnosis points at, each applied to the model and rerun on the user's own
workload, interleaved with the baseline in one run (this machine is noisy: only side-by-side ratios mean anything).

Options (names used by `whatifs=`):
    w8, w4            INT8 / INT4 RTN weights (the model's recipe in recipes/ when it has one), quantized on the fly
    kv-int8, kv-int4  a quantized KV cache (conf/kv/)
    lookup, self      speculative decoding with a prompt-lookup or a self (INT4 own-weights) draft (conf/spec/)
    compile           torch.compile the decode step (engine.compile=true, with torch's kernels: fbgemm's op breaks the
                      graph); the first step pays the compilation (~1-2 min, in the untimed warm-up)
    prefix-cache      the prompts in order through one paged KV cache with prefix reuse, as `specquant serve
                      prefix_cache=true` runs them: later prompts skip the whole blocks earlier ones began with
                      (prefix_cache.py)
    bf16-prefill      the prompt's products in bf16, decode unchanged (engine.prefill_dtype=bf16): models with
                      half-stored float weights under fp32 activations (int4 checkpoints too: their 4-bit layers
                      dequantize to bf16), on a CPU with native bf16
"""

from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

from toolkit.diagnose.prefix_cache import PrefixCacheRun
from toolkit.engine.generate import generate
from toolkit.engine.precision import cpu_has_native_bf16, prefill_runs_bf16
from toolkit.engine.setup import load_engine_model, prepare_engine_model
from toolkit.engine.spec import EngineSpec
from toolkit.errors import InputError
from toolkit.kv import KVSpec, kv_spec
from toolkit.models import load_model
from toolkit.paths import RECIPES_DIR, quantize_option
from toolkit.quant.model_quant import (
    QuantRecipe,
    quantize_model,
    swap_quantized_modules,
)
from toolkit.quant.qlinear import QuantLinear
from toolkit.spec.build import build_draft, draft_length
from toolkit.spec.decode import speculative_generate

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
ALL = ("w8", "w4", "kv-int8", "kv-int4", "lookup", "self", "compile", "prefix-cache", "bf16-prefill")
KNOB = {"baseline": "none", "w8": "weights", "w4": "weights", "kv-int8": "kv", "kv-int4": "kv", "lookup": "spec",
        "self": "spec", "compile": "engine", "prefix-cache": "prefix", "bf16-prefill": "prefill"}
# why an option is applied where it is, when its command is not the baseline's plus an override
EXPLAIN = {"prefix": "prefix caching lives in the server: requests that begin like an earlier one reuse its cached "
                     "KV blocks and prefill only the rest (`specquant generate` runs every prompt cold)"}
_WEIGHT_RECIPES = {"w8": ("rtn-w8", "rtn-int8", {}), "w4": ("rtn-w4g64", "rtn-int4", {"group_size": 64})}
# KV what-ifs are worth running when the cache is at least this share of a decode step's bytes
KV_SHARE_WORTH_IT = 0.1


@dataclass
class Option:
    name: str
    knob: str
    model: torch.nn.Module
    kv: KVSpec = field(default_factory=KVSpec)
    spec: object = None  # a conf/spec node, or None
    draft: object = None
    prefix: object = None  # a PrefixCacheRun (prefix-cache): the paged cache the requests share
    apply: str = ""  # the command (or overrides) that applies this option for real
    recipe: dict | None = None  # the weight recipe applied (weights options)
    timings: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    cached_tokens: list = field(default_factory=list)  # prefix-cache: prompt tokens each request found cached


def choose(requested, dominant: str, kv_share_of_decode: float, repeated_prefix_share: float = 0.0) -> list[str]:
    """`whatifs=auto`: weights always (they cut the bytes decode streams and the matmul work prefill does), KV when
    the cache is a real share of decode bytes, speculative drafts only for a decode-dominated workload (they do not
    touch TTFT), the prefix cache when some prompt begins like an earlier one, bf16 prompt products for a
    prefill-dominated one on a CPU with native bf16. `all`, `none`, or a list of names choose explicitly."""
    if requested in (None, "auto"):
        names = ["w8", "w4"]
        if kv_share_of_decode >= KV_SHARE_WORTH_IT:
            names += ["kv-int8", "kv-int4"]
        if dominant == "decode":  # per-step overhead (not bytes) is what compile removes: decode only
            names += ["lookup", "self", "compile"]
        if repeated_prefix_share > 0:
            names += ["prefix-cache"]
        if dominant == "prefill" and cpu_has_native_bf16():
            names += ["bf16-prefill"]
        return names
    if requested == "all":
        return list(ALL)
    if requested in ("none", "", []):
        return []
    names = [requested] if isinstance(requested, str) else list(requested)
    unknown = [n for n in names if n not in ALL]
    if unknown:
        raise InputError(f"unknown what-if(s) {', '.join(map(str, unknown))}",
                         f"use whatifs=auto, all, none or a list of: {', '.join(ALL)}")
    return names


def weight_recipe(option: str, model_name: str):
    """(QuantRecipe, how to apply it on the command line) for w8/w4: the model's own recipe file when recipes/ has
    one, else the generic conf/quantize/ recipe."""

    recipe_name, generic, overrides = _WEIGHT_RECIPES[option]
    own = RECIPES_DIR / str(model_name) / f"{recipe_name}.yaml"
    if own.is_file():
        node = OmegaConf.to_container(OmegaConf.load(own))["quantize"]
        apply = f"specquant quantize recipe={model_name}/{recipe_name} output=DIR"
    else:
        node = quantize_option(generic)
        node.update(overrides)
        extra = "".join(f" quantize.{k}={v}" for k, v in overrides.items())
        apply = f"specquant quantize model={model_name} quantize={generic}{extra} output=DIR"
    return QuantRecipe(**node), apply


def quantized_copy(model_name: str, recipe, engine: EngineSpec):
    """A fresh copy of the model with its Linear weights quantized by `recipe` (RTN: seconds), prepared for the
    engine exactly as a checkpoint written by `specquant quantize` and loaded with model=DIR would be."""

    model = load_model(model_name, dtype=torch.float32).model
    qsd = quantize_model(model, recipe, progress=False)
    swap_quantized_modules(model, qsd, QuantLinear.from_quantized)
    prepare_engine_model(model, engine)
    return model


def compiled_copy(model_name: str, engine: EngineSpec):
    """A fresh copy of the model (a checkpoint directory too) prepared as the engine would with engine.compile=true:
    torch's kernels (fbgemm's packed op is opaque to the compiler and breaks the graph) and a compiled decode
    forward. A copy, because compiling attaches the compiled forward to the model the baseline also runs."""

    return load_engine_model(model_name, engine.replace(gemm="torch", compile=True)).model


def bf16_prefill_copy(model_name: str, engine: EngineSpec) -> tuple[torch.nn.Module | None, str]:
    """(a fresh copy of the model prepared with engine.prefill_dtype=bf16, "") or (None, why it does not apply)."""

    try:
        loaded = load_engine_model(model_name, engine.replace(prefill_dtype="bf16"))
    except InputError as exc:  # a CPU without native bf16
        return None, exc.problem
    if loaded.precision.prefill != "bf16":
        return None, (f"applies to fp16-stored weights under fp32 activations (engine.dtype=auto); this engine runs "
                      f"{loaded.precision.name}")
    return loaded.model, ""


def build_options(names: list[str], base, model_name: str, engine: EngineSpec, kv: KVSpec | None, spec_cfg,
                  tokenizer, quantized_input: bool) -> tuple[list[Option], list[str]]:
    """The baseline (the user's own settings: `engine`, `kv` (None: fp) and `spec_cfg`) and each named option;
    returns them and notes on options skipped."""

    kv = kv_spec(kv)
    notes = []
    baseline = Option("baseline", "none", base, kv, spec_cfg, apply="(as you ran it)")
    options = [baseline]
    for name in names:
        knob = KNOB[name]
        if knob == "weights":
            if quantized_input:
                notes.append(f"{name}: skipped, model={model_name} is already quantized")
                continue
            recipe, apply = weight_recipe(name, model_name)
            options.append(Option(name, knob, quantized_copy(model_name, recipe, engine), kv, spec_cfg,
                                  apply=apply, recipe=recipe.to_dict()))
        elif knob == "kv":
            kind = name.removeprefix("kv-")
            if kv.kind == kind:
                notes.append(f"{name}: skipped, the baseline already runs kv={kind}")
                continue
            option_kv = KVSpec.from_node(OmegaConf.load(CONF_DIR / "kv" / f"{kind}.yaml"))  # as kv={kind} runs
            options.append(Option(name, knob, base, option_kv, spec_cfg, apply=f"kv={kind}"))
        elif knob == "engine":
            if engine.compile:
                notes.append(f"{name}: skipped, the baseline already runs engine.compile=true")
                continue
            options.append(Option(name, knob, compiled_copy(model_name, engine), kv, spec_cfg,
                                  apply="engine.compile=true engine.gemm=torch"))
        elif knob == "prefill":
            if prefill_runs_bf16(base):
                notes.append(f"{name}: skipped, the baseline already runs bf16 prompt passes")
                continue
            copy, why = bf16_prefill_copy(model_name, engine)
            if copy is None:
                notes.append(f"{name}: skipped, {why}")
                continue
            options.append(Option(name, knob, copy, kv, spec_cfg, apply="engine.prefill_dtype=bf16"))
        elif knob == "prefix":

            # one knob at a time: against a baseline that already changes the cache or the decoding loop, the
            # paged run would differ in two knobs and its tokens would not be the baseline's by construction
            if kv.quantized or spec_cfg is not None:
                notes.append(f"{name}: skipped, measured against a kv=fp baseline without spec= only")
                continue
            options.append(Option(name, knob, base, prefix=PrefixCacheRun(base), apply="prefix_cache=true"))
        else:
            if spec_cfg is not None and spec_cfg.get("kind") == name:
                notes.append(f"{name}: skipped, the baseline already runs spec={name}")
                continue
            node = OmegaConf.load(CONF_DIR / "spec" / f"{name}.yaml")
            options.append(Option(name, knob, base, kv, node, apply=f"spec={name}"))
    for option in options:
        if option.spec is not None and option.spec.get("kind", "none") != "none":
            option.draft = build_draft(option.spec, option.model, tokenizer, engine=engine)
    return options, notes


def run_once(option: Option, tokenizer, ids: list[int], new_tokens: int):
    """One request of the workload (exactly `new_tokens` tokens: end-of-sequence ignored, so every option does the
    same work); returns (token ids, timing)."""
    if option.prefix is not None:
        return option.prefix.run(ids, new_tokens)
    if option.draft is not None:

        out = speculative_generate(option.model, tokenizer, [ids], new_tokens, option.draft,
                                   draft_length(option.spec), stop_tokens=set(), kv=option.kv)
    else:
        out = generate(option.model, tokenizer, [ids], new_tokens, stop_tokens=set(), kv=option.kv)
    return out.sequences[0].token_ids, out.timing


def measure(options: list[Option], tokenizer, encoded: list[list[int]], new_tokens: int, warmup: int = 1,
            repeats: int = 1, progress=None) -> None:
    """Every option on every prompt, rotating which option goes first, after `warmup` untimed short runs each.
    A prefix cache starts each pass empty (its warm-up's blocks dropped too), so prompt i finds only prompts 0..i-1."""
    prefixed = [o for o in options if o.prefix is not None]
    for option in prefixed:
        option.prefix.start(encoded, new_tokens)
    for option in options:
        for _ in range(warmup):
            run_once(option, tokenizer, encoded[0][:64], min(new_tokens, 4))
    for rep in range(repeats):
        for option in prefixed:
            option.prefix.start(encoded, new_tokens)
        for i, ids in enumerate(encoded):
            shift = (rep * len(encoded) + i) % len(options)
            for option in options[shift:] + options[:shift]:
                tokens, timing = run_once(option, tokenizer, ids, new_tokens)
                option.timings.append(timing)
                if option.prefix is not None:
                    option.cached_tokens.append(option.prefix.last_cached)
                if rep == 0:
                    option.outputs.append(tokens)
                if progress:
                    progress(1)
