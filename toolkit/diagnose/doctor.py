"""The diagnosis, section by section, over one loaded model and the user's prompts: returns the report dict that
render prints and the CLI writes as JSON. Nothing here is estimated that could be measured."""

import torch
from omegaconf import OmegaConf

from toolkit.data import build_prompts
from toolkit.diagnose import whatifs as wi
from toolkit.diagnose.kv_pressure import default_budget, kv_pressure, sequence_kv_bytes
from toolkit.diagnose.prefix_cache import BLOCK_SIZE
from toolkit.diagnose.quality import quality_change, quality_slice
from toolkit.diagnose.recommend import rank, recommend
from toolkit.diagnose.roofline import measure_peaks, roofline
from toolkit.diagnose.split import dominant as dominant_path
from toolkit.diagnose.split import time_split
from toolkit.diagnose.workload import input_stats
from toolkit.engine.costs import kv_bytes_per_token, weight_bytes_per_token
from toolkit.engine.generate import encode_prompts
from toolkit.engine.spec import EngineSpec
from toolkit.errors import InputError
from toolkit.evaluation.generation import token_agreement
from toolkit.kv import KVSpec, fp_storage
from toolkit.model_state import peek
from toolkit.spec.build import build_draft


def workload_texts(cfg, tokenizer) -> list[str]:

    source = cfg.get("prompt_file") or cfg.get("prompts")
    if not source:
        raise InputError("no workload given", "pass prompts=SET (open, grounded, code, story) or prompt_file=PATH")
    return [p.text for p in build_prompts(source, tokenizer, cfg.prompt_tokens, cfg.n_prompts)]


def base_command(cfg) -> str:
    source = f"prompt_file={cfg.prompt_file}" if cfg.get("prompt_file") else \
        f"prompts={cfg.prompts} prompt_tokens={cfg.prompt_tokens}"
    return f"specquant generate model={cfg.model.name} {source} n_prompts={cfg.n_prompts} new_tokens={cfg.new_tokens}"


def cache_bytes_per_token(model, kv: KVSpec, context: int, dtype: torch.dtype) -> float:
    """Bytes a token takes in one sequence's cache, as stored (kv=fp: kv.dtype, fp16 under `auto` where the native
    stack reads it; docs/kv-cache.md)."""
    if not kv.quantized:
        return kv_bytes_per_token(model, fp_storage(model, kv)[0] or dtype)
    return sequence_kv_bytes(model, kv.kind, context, dtype, kv) / context


def prefix_reuse(options, names: list[str], workload: dict, notes: list[str]) -> dict | None:
    """What the prefix-cache what-if found in the cache, set against the repeated-prefix share of section 1 (only
    whole blocks are reused, and a prompt's last token always runs); None when it was not measured."""

    option = next((o for o in options if o.prefix is not None), None)
    if option is None:
        if workload["repeated_prefix_share"] > 0 and "prefix-cache" not in names:  # (else a note says why not)
            notes.append(f"prefix cache: not measured; {workload['repeated_prefix_share']:.1%} of prompt tokens "
                         "repeat an earlier prompt's start (add prefix-cache to whatifs= to measure it)")
        return None
    cached = option.cached_tokens[:workload["prompts"]]  # the first pass (each pass starts cold: they repeat it)
    share = sum(cached) / workload["tokens"] if workload["tokens"] else 0.0
    notes.append(f"prefix-cache: {sum(cached)} of {workload['tokens']} prompt tokens ({share:.1%}) found cached in "
                 f"whole {BLOCK_SIZE}-token blocks, of the {workload['repeated_prefix_tokens']} that repeat an "
                 "earlier prompt's start; KL 0 by construction ('same tokens' is the check)")
    return {"cached_tokens": sum(cached), "cached_per_prompt": cached, "cached_share": share,
            "block_size": BLOCK_SIZE, "repeated_prefix_tokens": workload["repeated_prefix_tokens"]}


def diagnose(cfg, loaded, engine: EngineSpec, kv: KVSpec, progress=None) -> dict:
    """`cfg`: the workload's settings (prompts, new_tokens, whatifs, quality...); `engine` and `kv`: the engine and
    KV cache the model was loaded and runs with, resolved once by the CLI."""
    model, tokenizer = loaded.model, loaded.tokenizer
    spec_cfg = cfg.get("spec") if cfg.get("spec") is not None and cfg.spec.get("kind") != "none" else None
    texts = workload_texts(cfg, tokenizer)
    encoded = encode_prompts(tokenizer, texts)
    workload = input_stats(texts, encoded)
    dtype = loaded.precision.compute
    new_tokens = int(cfg.new_tokens)

    # sections 2-3: the workload as the user runs it (its own kv= and spec=)
    baseline = wi.Option("baseline", "none", model, kv, spec_cfg)
    if spec_cfg is not None:

        baseline.draft = build_draft(spec_cfg, model, tokenizer, engine=engine)
    wi.measure([baseline], tokenizer, encoded, new_tokens, warmup=cfg.warmup, progress=progress)
    split = time_split(baseline.timings)
    path = dominant_path(split)
    peak_flops, bandwidth = measure_peaks()
    mean_prompt = workload["tokens_per_prompt"]
    context = max(len(ids) for ids in encoded) + new_tokens
    kv_per_token = cache_bytes_per_token(model, kv, context, dtype)
    window = kv.window_shape()  # a windowed cache reads at most what it holds
    bound = roofline(model, kv_per_token, mean_prompt, new_tokens, split, peak_flops, bandwidth,
                     window.capacity if window is not None else None)
    weights = weight_bytes_per_token(model)
    budget = int(cfg.kv_budget_gib * 2**30) if cfg.get("kv_budget_gib") else default_budget(weights)
    pressure = kv_pressure(model, context, dtype, budget)

    # section 5: the knobs the diagnosis points at, rerun beside the baseline
    kv_share = bound["decode"]["kv_bytes"] / bound["decode"]["bytes_per_token"]
    names = wi.choose(OmegaConf.to_container(cfg.whatifs) if OmegaConf.is_config(cfg.whatifs) else cfg.whatifs,
                      path, kv_share, workload["repeated_prefix_share"])
    quantized_input = peek(model).quant_label is not None
    options, notes = wi.build_options(names, model, cfg.model.name, engine, kv, spec_cfg, tokenizer,
                                      quantized_input)
    options[0].draft = baseline.draft
    wi.measure(options, tokenizer, encoded, new_tokens, warmup=cfg.warmup, progress=progress)
    windows = quality_slice(tokenizer, cfg.quality.data, cfg.quality.window, cfg.quality.windows)
    quality = quality_change(options, windows, cfg.quality.chunk)
    rows = {}
    for option in options:
        rows[option.name] = {**time_split(option.timings), **quality[option.name], "knob": option.knob,
                             "apply": option.apply, "explain": wi.EXPLAIN.get(option.knob, ""),
                             "token_agreement": token_agreement(option.outputs, options[0].outputs)}
    command = base_command(cfg)
    on_dir = command.replace(f"model={cfg.model.name} ", "model=DIR ", 1)
    served = f"specquant serve model={cfg.model.name}"
    overrides = ("kv", "spec", "engine", "prefill")  # options applied as overrides of the baseline's command
    apply = {o.name: (f"{command} {o.apply}" if o.knob in overrides else f"{o.apply} && {on_dir}"
                      if o.knob == "weights" else f"{served} {o.apply}" if o.knob == "prefix" else command)
             for o in options}
    for name, row in rows.items():
        row["command"] = apply[name]
    recommendation = recommend(rows, path, cfg.kl_budget, cfg.min_gain, apply, command)
    prefix = prefix_reuse(options, names, workload, notes)
    return {
        "model": loaded.name, "dtype": loaded.precision.name, "prompt_tokens": mean_prompt, "new_tokens": new_tokens,
        "workload": workload, "split": split, "dominant": path, "roofline": bound, "kv_pressure": pressure,
        "whatifs": {"measured": [o.name for o in options], "rows": rows, "ranking": rank(rows), "notes": notes,
                    "prefix_cache": prefix, "quality_slice": {"data": cfg.quality.data, "window": cfg.quality.window,
                                      "windows": int(windows.shape[0]), "chunk": cfg.quality.chunk}},
        "recommendation": recommendation,
    }
