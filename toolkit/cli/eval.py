"""specquant eval: quality of a model as the engine runs it, against its reference (the float model in fp32 with a
full-precision KV cache; see toolkit.evaluation.models), on held-out text; JSON to `out=`, a line to the store."""

import contextlib
import sys

from omegaconf import OmegaConf
from rich.console import Console

from toolkit.data.chat import DOMAINS, domain_texts
from toolkit.engine.spec import EngineSpec
from toolkit.errors import InputError
from toolkit.evaluation.models import load_candidate, load_reference
from toolkit.evaluation.suite import Settings, resolve_tasks, run_tasks
from toolkit.kv import KVSpec
from toolkit.machine import machine_facts
from toolkit.model_state import peek
from toolkit.quant.qlinear import exact_prefill
from toolkit.results import append_to_store, make_result, write_result

console = Console(width=None if sys.stdout.isatty() else 150)

_SETTINGS = ("window", "max_windows", "batch_size", "chunk", "items", "max_context", "item_batch_size",
             "gen_prompts", "gen_prompt_tokens", "gen_new_tokens")


def evaluate_model(cfg) -> dict:

    tasks = resolve_tasks(cfg.task)
    kv = KVSpec.from_node(cfg.kv)  # resolved once, here
    kind = kv.kind
    settings = Settings(**{key: cfg[key] for key in _SETTINGS})
    split = cfg.data.get("split", "evaluation")
    domains = list(DOMAINS) if cfg.data.name == "domains" else None
    if domains and tasks != ["ppl"]:
        raise InputError(f"data=domains measures perplexity only, asked for task={cfg.task}",
                         "use task=ppl with data=domains, or one dataset (data=austen) for the other tasks")
    loaded = load_candidate(cfg.model.name, EngineSpec.from_node(cfg.engine))
    reference, reference_name = load_reference(cfg.model.name, loaded, kind, cfg.get("reference"))
    quant = peek(loaded.model).quant_label
    running = f"{quant} Linear weights, the rest {loaded.precision.name}" if quant else loaded.precision.name
    exact = bool(cfg.get("exact_prefill", False))
    console.print(f"[bold]{loaded.name}[/] ({running}, KV {kv}"
                  + (", int8 layers' many-row products exact" if exact else "") + f") vs reference {reference_name}")
    per_domain = {}
    for name in domains or [cfg.data.name]:
        texts = domain_texts(name, split, loaded.tokenizer)
        data = f"{DOMAINS.get(name, name)}/{split}"
        with exact_prefill() if exact else contextlib.nullcontext():
            out = run_tasks(loaded.model, loaded.tokenizer, texts, tasks, settings, reference, kv, data,
                            log=lambda line: console.print(f"  protocol {line}", style="dim", highlight=False),
                            progress=sys.stderr.isatty())
        found = {**out["figures"], "data": data, "protocol": out["protocol"], "seconds": out["seconds"]}
        if "ppl" in found:
            found["ppl_increase"] = found["ppl"] / found["ref_ppl"] - 1
        per_domain[name] = found
    # several domains: the headline figures are the worst domain's (what report and recommend rank by)
    worst = max(per_domain, key=lambda d: per_domain[d].get("ppl_increase", 0))
    figures = {"model": loaded.name, "dtype": loaded.precision.name, "kv": str(kv), "tasks": tasks,
               "quant": quant, "reference": reference_name, "exact_prefill": exact, **per_domain[worst]}
    if domains:
        figures.update(data=f"domains/{split}", worst_domain=worst, domains=per_domain)
    return make_result("eval", OmegaConf.to_container(cfg, resolve=True), figures, machine_facts(measure=False))


def print_figures(result: dict) -> None:
    for name, found in result.get("domains", {}).items():
        console.print(f"{name:<8}{found['data']:<26}perplexity {found['ppl']:9.3f}   reference {found['ref_ppl']:9.3f}"
                      f"   {100 * found['ppl_increase']:+7.2f}%   KL {found['kl']:.4f}", highlight=False)
    if "worst_domain" in result:
        console.print(f"worst domain: {result['worst_domain']}; its figures:", highlight=False)
    rows = [("perplexity", "ppl", "ref_ppl", "{:.3f}"), ("KL (nats/token)", "kl", None, "{:.5f}"),
            ("top-1 agreement", "top1_agreement", None, "{:.4f}"),
            ("cloze accuracy", "cloze_accuracy", "ref_cloze_accuracy", "{:.3f}"),
            ("mc accuracy", "mc_accuracy", "ref_mc_accuracy", "{:.3f}"),
            ("mc accuracy (norm)", "mc_accuracy_norm", "ref_mc_accuracy_norm", "{:.3f}"),
            ("gen prefix match", "gen_prefix_match", None, "{:.3f}"),
            ("gen token agreement", "gen_token_agreement", None, "{:.3f}")]
    for label, key, ref, fmt in rows:
        if key in result:
            line = f"{label:<22}{fmt.format(result[key])}"
            if ref:
                line += f"   reference {fmt.format(result[ref])}"
            console.print(line, highlight=False)
    if "ppl_increase" in result:
        console.print(f"{'ppl increase':<22}{100 * result['ppl_increase']:+.2f}%", highlight=False)


def run(cfg) -> dict:
    result = evaluate_model(cfg)
    print_figures(result)
    if cfg.out:
        console.print(f"wrote {write_result(cfg.out, result)}")
    stored = append_to_store(result, cfg.store)
    if stored:
        console.print(f"appended to {stored}", style="dim")
    return result
