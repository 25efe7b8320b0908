"""specquant bench: engine vs transformers generate(), interleaved in one run; a table on screen, JSON to `out=`."""

import copy
import sys

import torch
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from toolkit.bench import llamacpp
from toolkit.bench.baseline import float_source
from toolkit.bench.latency import run_latency_bench
from toolkit.bench.spec import print_spec_table, spec_bench
from toolkit.data import build_prompts
from toolkit.engine.kernel_paths import kernel_paths, summary
from toolkit.engine.precision import prepare_model, resolve_precision
from toolkit.engine.setup import (
    configure_engine,
    load_quantized_model,
    prepare_engine_model,
)
from toolkit.engine.spec import EngineSpec
from toolkit.errors import InputError
from toolkit.kv import KVSpec, kv_spec
from toolkit.machine import machine_facts
from toolkit.models import load_model
from toolkit.quant.formats import is_quantized_model
from toolkit.results import append_to_store, make_result, write_result
from toolkit.spec.config import SpecConfig

console = Console(width=None if sys.stdout.isatty() else 150)


def bench(model_name: str, engine: EngineSpec, prompts: str, prompt_tokens: int, new_tokens: int, n_prompts: int,
          repeats: int, warmup: int, baseline: str, baseline_dtype: str, config: dict,
          kv: KVSpec | None = None) -> dict:
    """Load once, build prompts, time both paths; returns the result record (also used by `demo`)."""

    wanted = set(str(baseline).split(","))
    if not wanted <= {"hf", "none", "llamacpp"}:
        raise InputError(f"unknown baseline {baseline!r}",
                         "use baseline=hf, llamacpp, hf,llamacpp or none (a comma-separated list)")
    baseline = "hf" if "hf" in wanted else "none"
    threads = configure_engine(engine)
    reference = None
    if is_quantized_model(model_name):  # ours, or GPTQ/AWQ format
        # the baseline is transformers on the float model the checkpoint was quantized from
        loaded = load_quantized_model(model_name)
        if baseline == "hf":
            reference = load_model(float_source(model_name)).model
    else:
        loaded = load_model(model_name)
        if baseline == "hf":
            reference = copy.deepcopy(loaded.model)
    if reference is not None:
        prepare_model(reference, resolve_precision(baseline_dtype))
    texts = build_prompts(prompts, loaded.tokenizer, prompt_tokens, n_prompts)
    prompt_ids = [loaded.tokenizer(p.text).input_ids for p in texts]
    prepare_engine_model(loaded.model, engine)
    peer, peer_missing = None, None
    if "llamacpp" in wanted:
        peer_missing = llamacpp.unavailable()
        if peer_missing is None:
            n_ctx = max(len(ids) for ids in prompt_ids) + new_tokens + 16
            peer = llamacpp.peer_for(model_name, llamacpp.checkpoint_bits(model_name), n_ctx,
                                     threads or torch.get_num_threads(), llamacpp.kv_type(kv_spec(kv).kind))
    machine = machine_facts(measure=True)
    with console.status(f"timing {len(prompt_ids)} prompts x {repeats} repeats, engine"
                        + (" and transformers generate() interleaved" if reference is not None else "")):
        figures = run_latency_bench(loaded.model, loaded.tokenizer, reference, prompt_ids, new_tokens, repeats,
                                    warmup, machine["memory_bandwidth_gbs"] * 1e9, kv=kv, llamacpp=peer)
    if peer_missing:
        figures["llamacpp"] = {"unavailable": peer_missing}
    figures = {"model": loaded.name, "prompts": prompts, "threads": threads, "kernels": kernel_paths(loaded.model),
               **figures}
    return make_result("bench", config, figures, machine)


def print_table(result: dict) -> None:
    rows = [("engine (specquant)", result)]
    if "baseline" in result:
        rows.append(("transformers generate()", result["baseline"]))
    if "ttft_ms" in result.get("llamacpp", {}):
        rows.append(("llama.cpp (llama-cpp-python)", result["llamacpp"]))
    table = Table(title=f"{result['model']} | prompts={result['prompts']} | {result['prompt_tokens']} prompt tokens, "
                        f"{result['new_tokens']} new | {result['runs']} runs | {result['threads']} threads")
    for column in ("path", "dtype", "TTFT ms", "ITL p50 ms", "ITL p90 ms", "ITL p99 ms", "decode tok/s",
                   "floor tok/s", "x floor", "peak RSS MB"):
        table.add_column(column, justify="right" if column != "path" else "left")
    for name, r in rows:
        itl, floor = r["itl_ms"], r["decode_floor"]
        table.add_row(name, r["dtype"], f"{r['ttft_ms']:.1f}", f"{itl['p50']:.1f}", f"{itl['p90']:.1f}",
                      f"{itl['p99']:.1f}", f"{r['decode_tokens_per_s']:.1f}", f"{floor['floor_tokens_per_s']:.1f}",
                      f"{floor['times_floor']:.2f}", f"{r['peak_rss_mb']:.0f}")
    console.print(table)
    m = result["machine"]
    console.print(f"machine: {m['cpu']}, {m['cores']} cores, native bf16: {m['native_bf16']}, measured read bandwidth "
                  f"{m['memory_bandwidth_gbs']:.1f} GB/s, fp32 matmul {m['matmul_fp32_gflops']:.0f} GFLOP/s")
    if "kernels" in result:
        console.print(summary(result["kernels"]), highlight=False)
    console.print("floor = bytes one decode step must read (weights + KV at the mean context) / measured bandwidth",
                  style="dim")
    if "baseline" in result:
        console.print(f"decode speedup vs transformers generate(): [bold]{result['speedup_vs_baseline']:.2f}x[/]   "
                      f"TTFT speedup: {result['ttft_speedup_vs_baseline']:.2f}x   greedy token agreement "
                      f"({result['dtype']} vs {result['baseline']['dtype']}): "
                      f"{result['greedy_token_agreement_vs_baseline']:.3f}")
    peer = result.get("llamacpp", {})
    if "unavailable" in peer:
        console.print(f"llama.cpp: no row -- {peer['unavailable']}", style="yellow", highlight=False)
    elif peer:
        console.print(f"vs llama.cpp ({peer['dtype']}, same prompts and threads, interleaved): decode "
                      f"[bold]{result['speedup_vs_llamacpp']:.2f}x[/], TTFT {result['ttft_speedup_vs_llamacpp']:.2f}x, "
                      f"greedy token agreement {result['greedy_token_agreement_vs_llamacpp']:.3f}")
    if "kv_bytes" in result:
        console.print(f"engine KV cache at the end: {result['kv_bytes'] / 2**20:.2f} MiB for {result['kv_tokens']} "
                      f"tokens = {result['kv_ratio_to_bf16']:.3f}x a bf16 cache")


def run(cfg) -> dict:
    spec = SpecConfig.of(cfg.get("spec"))  # resolved once, here
    engine, kv = EngineSpec.from_node(cfg.engine), KVSpec.from_node(cfg.kv)
    if spec.kind != "none":  # the same target without vs with speculation (toolkit/bench/spec)

        result = spec_bench(cfg.model.name, engine, spec, cfg.prompts, cfg.prompt_tokens, cfg.new_tokens,
                            cfg.n_prompts, cfg.repeats, cfg.warmup, OmegaConf.to_container(cfg, resolve=True),
                            kv=kv, baseline=cfg.baseline, baseline_dtype=cfg.baseline_dtype)
        print_spec_table(result, console)
    else:
        result = bench(cfg.model.name, engine, cfg.prompts, cfg.prompt_tokens, cfg.new_tokens, cfg.n_prompts,
                       cfg.repeats, cfg.warmup, cfg.baseline, cfg.baseline_dtype,
                       OmegaConf.to_container(cfg, resolve=True), kv=kv)
        print_table(result)
    if cfg.out:
        console.print(f"wrote {write_result(cfg.out, result)}")
    # every run also lands in the results store that `specquant report` reads (+store=PATH, or +store=none)
    if stored := append_to_store(result, cfg.get("store")):
        console.print(f"appended to {stored}", style="dim")
    return result
