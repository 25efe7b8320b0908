"""specquant diagnose: the latency doctor (toolkit/diagnose/) on the user's workload; terminal report, JSON, PNG."""

import sys

from omegaconf import OmegaConf
from rich.console import Console

from toolkit.diagnose.doctor import diagnose
from toolkit.diagnose.render import plot_split, print_report
from toolkit.engine.kernel_paths import kernel_paths
from toolkit.engine.setup import load_engine_model
from toolkit.engine.spec import EngineSpec
from toolkit.kv import KVSpec
from toolkit.machine import machine_facts
from toolkit.results import make_result, write_result

console = Console(width=None if sys.stdout.isatty() else 140)


def run(cfg) -> dict:
    engine, kv = EngineSpec.from_node(cfg.engine), KVSpec.from_node(cfg.get("kv"))  # resolved once, here
    loaded = load_engine_model(cfg.model.name, engine)
    report = diagnose(cfg, loaded, engine, kv)
    report["kernels"] = kernel_paths(loaded.model)
    print_report(report, console)
    result = make_result("diagnose", OmegaConf.to_container(cfg, resolve=True), report, machine_facts(measure=False))
    if cfg.out:
        write_result(cfg.out, result)
        console.print(f"wrote {cfg.out}", highlight=False)
    if cfg.plot:
        plot_split(report, cfg.plot)
        console.print(f"wrote {cfg.plot}", highlight=False)
    return result
