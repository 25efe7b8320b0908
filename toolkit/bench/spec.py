"""`specquant bench spec=...`: the same target with and without speculative decoding, interleaved in one run.

Both paths run the same prompts, threads and KV cache kind in one process, alternating which goes first (this
machine is noisy: only ratios measured side by side mean anything). Each generates exactly `new_tokens` tokens
(end-of-sequence ignored), greedy, so their outputs must be token-identical and their times compare like with like.

Figures: `speedup_vs_nospec` = no-spec wall time / spec wall time over the same runs, prompt included (what a user
waits for); `decode_speedup_vs_nospec` leaves both prefills out (the spec side's time after its first token
includes the draft's own prefill, which is part of its cost). `identical_outputs`: every run's tokens equal.
"""

import statistics
import time
from collections import Counter

import torch

from toolkit.bench import llamacpp
from toolkit.bench.interleave import interleaved
from toolkit.bench.repeats import Run, repeat_ratios
from toolkit.bench.peers import (
    TRANSFORMERS_LOOKUP_TOKENS,
    assisted_draft_peer,
    assisted_lookup_peer,
)
from toolkit.data import build_prompts
from toolkit.engine.generate import generate
from toolkit.engine.kernel_paths import kernel_paths
from toolkit.engine.precision import model_precision, prepare_model, resolve_precision
from toolkit.engine.setup import load_engine_model
from toolkit.engine.spec import EngineSpec
from toolkit.errors import InputError
from toolkit.evaluation.generation import token_agreement
from toolkit.kv import KVSpec, kv_spec
from toolkit.machine import machine_facts
from toolkit.model_state import peek
from toolkit.models import load_model
from toolkit.quant.checkpoint import is_quantized_checkpoint, read_manifest
from toolkit.quant.formats import is_quantized_model
from toolkit.results import make_result
from toolkit.spec.build import build_draft, describe_draft, draft_length
from toolkit.spec.decode import DraftLength, speculative_generate


def _nospec(model, tokenizer, ids, new_tokens, kv):
    start = time.perf_counter()
    out = generate(model, tokenizer, [ids], new_tokens, stop_tokens=set(), kv=kv)
    total = time.perf_counter() - start
    return out.sequences[0].token_ids, total, out.timing.ttft_s, None


def _spec(model, tokenizer, ids, new_tokens, kv, draft, length):
    start = time.perf_counter()
    out = speculative_generate(model, tokenizer, [ids], new_tokens, draft, length, stop_tokens=set(), kv=kv)
    total = time.perf_counter() - start
    return out.sequences[0].token_ids, total, out.timing.ttft_s, out.stats


def _llamacpp(peer, ids, new_tokens):
    tokens, timing = peer.run(ids, new_tokens)
    return tokens, timing.ttft_s + timing.decode_s, timing.ttft_s, None


def run_spec_bench(model, tokenizer, draft, length: DraftLength, prompts: list[list[int]], new_tokens: int,
                   repeats: int, warmup: int, kv: KVSpec | None = None, llamacpp=None) -> dict:
    """Time `model` alone and with `draft` on token-id prompts, interleaved (and llama.cpp's plain decode,
    `toolkit.bench.llamacpp.LlamaCpp`, where given); figures as the module says."""
    if repeats < 1 or new_tokens < 2:
        raise InputError("bench needs repeats >= 1 and new_tokens >= 2", "raise repeats / new_tokens")
    paths = {"nospec": lambda ids: _nospec(model, tokenizer, ids, new_tokens, kv),
             "spec": lambda ids: _spec(model, tokenizer, ids, new_tokens, kv, draft, length)}
    if llamacpp is not None:
        paths["llamacpp"] = lambda ids: _llamacpp(llamacpp, ids, new_tokens)
    totals = {name: [] for name in paths}
    prefills = {name: [] for name in paths}
    outputs = {name: [] for name in paths}
    pooled = Counter()
    histogram = Counter()
    runs = {name: [] for name in paths}
    for rep, name, ids in interleaved(paths, prompts, repeats, warmup):
        tokens, total, ttft, stats = paths[name](ids)
        runs[name].append(Run(rep, ttft, len(tokens) - 1, total - ttft))
        totals[name].append(total)
        prefills[name].append(ttft)
        outputs[name].append(tokens)
        if stats is not None:
            pooled.update({"proposed": stats.proposed, "accepted": stats.accepted, "rounds": stats.rounds,
                           "row_rounds": stats.row_rounds})
            pooled["draft_s"] += stats.draft_s
            pooled["verify_s"] += stats.verify_s
            histogram.update(stats.histogram)
    generated = sum(len(t) for t in outputs["spec"])
    same = [a == b for a, b in zip(outputs["spec"], outputs["nospec"])]
    nospec_s, spec_s = sum(totals["nospec"]), sum(totals["spec"])
    nospec_decode = nospec_s - sum(prefills["nospec"])
    spec_decode = spec_s - sum(prefills["spec"])
    precision = model_precision(model)
    label = peek(model).quant_label
    figures = {
        "dtype": f"{label} + {precision.name}" if label else precision.name,
        "prompt_tokens": round(statistics.mean(len(p) for p in prompts)),
        "new_tokens": new_tokens,
        "runs": len(totals["spec"]),
        "acceptance_rate": pooled["accepted"] / pooled["proposed"] if pooled["proposed"] else float("nan"),
        "mean_accepted": pooled["accepted"] / pooled["row_rounds"] if pooled["row_rounds"] else float("nan"),
        "tokens_per_target_pass": generated / (pooled["rounds"] + len(totals["spec"])),  # + 1 prefill pass per run
        "accepted_histogram": {int(k): v for k, v in sorted(histogram.items())},
        "draft_s": pooled["draft_s"],
        "verify_s": pooled["verify_s"],
        # the spec path's own latency figures, comparable with a plain bench row: prefill (TTFT) and the tokens
        # after the first per second of the rest; per-token ITL percentiles mean little when tokens arrive in
        # bursts of accepted drafts, so the mean is given
        "ttft_ms": 1000 * statistics.mean(prefills["spec"]),
        "decode_tokens_per_s": (generated - len(totals["spec"])) / spec_decode,
        "itl_ms": {"mean": 1000 * spec_decode / (generated - len(totals["spec"]))},
        "nospec_tokens_per_s": generated / nospec_s,
        "spec_tokens_per_s": generated / spec_s,
        "speedup_vs_nospec": nospec_s / spec_s,
        "decode_speedup_vs_nospec": nospec_decode / spec_decode,
        "identical_outputs": all(same),
        "identical_runs": f"{sum(same)}/{len(same)}",
        "first_divergence": [_first_difference(a, b) for a, b in zip(outputs["spec"], outputs["nospec"])],
    }
    if llamacpp is not None:  # speculation against what a llama.cpp user gets without it, same prompts and threads
        theirs_decode = sum(totals["llamacpp"]) - sum(prefills["llamacpp"])
        theirs_tokens = sum(len(t) for t in outputs["llamacpp"])
        figures["llamacpp"] = {"dtype": llamacpp.describe(), "gguf": str(llamacpp.path), "weights": llamacpp.weights,
                               "kv_type": getattr(llamacpp, "kv_type", "f16"),
                               "ttft_ms": 1000 * statistics.mean(prefills["llamacpp"]),
                               "decode_tokens_per_s": (theirs_tokens - len(totals["llamacpp"])) / theirs_decode}
        figures["speedup_vs_llamacpp"] = figures["decode_tokens_per_s"] / figures["llamacpp"]["decode_tokens_per_s"]
        figures["ttft_speedup_vs_llamacpp"] = figures["llamacpp"]["ttft_ms"] / figures["ttft_ms"]
        figures["greedy_token_agreement_vs_llamacpp"] = token_agreement(outputs["spec"], outputs["llamacpp"])
        figures["vs_llamacpp"] = repeat_ratios(runs["spec"], runs["llamacpp"])
    return figures


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (None when identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def spec_bench(model_name: str, engine: EngineSpec, spec_cfg, prompts: str, prompt_tokens: int, new_tokens: int,
               n_prompts: int, repeats: int, warmup: int, config: dict, kv: KVSpec | None = None,
               baseline: str = "none", baseline_dtype: str = "fp32") -> dict:
    """Load the target, build the draft `spec_cfg` names, time both paths; returns the result record.
    baseline=hf with spec=lookup and the fp cache on a float model also times the peer, transformers' assisted
    generation with prompt lookup on that model in fp32 (toolkit.bench.peers): once per float model, not again for
    each KV kind or for each checkpoint quantized from it."""

    loaded = load_engine_model(model_name, engine)
    texts = build_prompts(prompts, loaded.tokenizer, prompt_tokens, n_prompts)
    prompt_ids = [loaded.tokenizer(p.text).input_ids for p in texts]
    draft = build_draft(spec_cfg, loaded.model, loaded.tokenizer, engine=engine)
    length = draft_length(spec_cfg)
    machine = machine_facts(measure=True)
    peer, peer_missing = None, None
    if "llamacpp" in str(baseline).split(","):
        peer_missing = llamacpp.unavailable()
        if peer_missing is None:
            n_ctx = max(len(ids) for ids in prompt_ids) + new_tokens + 16
            peer = llamacpp.peer_for(model_name, llamacpp.checkpoint_bits(model_name), n_ctx, torch.get_num_threads(),
                                     llamacpp.kv_type(kv_spec(kv).kind))
    figures = run_spec_bench(loaded.model, loaded.tokenizer, draft, length, prompt_ids, new_tokens, repeats, warmup,
                             kv=kv, llamacpp=peer)
    if peer_missing:
        figures["llamacpp"] = {"unavailable": peer_missing}
    figures = {"model": loaded.name, "prompts": prompts, "threads": torch.get_num_threads(), "spec": spec_cfg.kind,
               "draft": describe_draft(draft), "k": length.k, "adaptive": length.adaptive,
               "kernels": kernel_paths(loaded.model), **figures}
    if "hf" in str(baseline).split(",") and not is_quantized_model(model_name) and not kv_spec(kv).quantized:
        figures.update(_peer(model_name, spec_cfg, prompt_ids, new_tokens, length, repeats, warmup, baseline_dtype))
    return make_result("bench", config, figures, machine)


def _peer(model_name: str, spec_cfg, prompt_ids, new_tokens: int, length: DraftLength, repeats: int, warmup: int,
          baseline_dtype: str) -> dict:
    """{"peer_assisted": ...}: transformers' assisted generation with the same kind of draft on the float models
    (toolkit.bench.peers), for spec=lookup and for spec=draft; {} otherwise. A draft that is one of our quantized
    checkpoints is run by the peer as the float model it was made from (its manifest's `source`): the same pair,
    as transformers can run it; a foreign GPTQ/AWQ draft gets no peer."""

    if spec_cfg.kind not in ("lookup", "draft"):
        return {}
    draft_name = ""
    if spec_cfg.kind == "draft":
        draft_name = str(spec_cfg.model or "")
        if is_quantized_checkpoint(draft_name):  # ours: the float model it was made from
            draft_name = str(read_manifest(draft_name).get("source") or "")
        if not draft_name or is_quantized_model(draft_name):
            return {}

    def reference(name):
        model = load_model(name).model.eval()
        prepare_model(model, resolve_precision(baseline_dtype))
        return model

    target = reference(model_name)
    peer = {"model": model_name, "dtype": baseline_dtype}
    if spec_cfg.kind == "lookup":
        return {"peer_assisted": {**peer, **assisted_lookup_peer(target, prompt_ids, new_tokens,
                                                                  TRANSFORMERS_LOOKUP_TOKENS, repeats, warmup)}}
    return {"peer_assisted": {**peer, "draft": draft_name,
                              **assisted_draft_peer(target, reference(draft_name), prompt_ids, new_tokens, repeats,
                                                    warmup)}}


def print_spec_table(result: dict, console) -> None:
    from rich.table import Table

    table = Table(title=f"{result['model']} | prompts={result['prompts']} | {result['prompt_tokens']} prompt tokens, "
                        f"{result['new_tokens']} new | {result['runs']} runs per path | greedy")
    for column in ("path", "draft", "tok/s", "acceptance", "mean accepted", "tokens / target pass",
                   "draft s", "verify s"):
        table.add_column(column, justify="left" if column in ("path", "draft") else "right")
    table.add_row("target alone", "-", f"{result['nospec_tokens_per_s']:.1f}", "-", "-", "1.00", "-", "-")
    k = f"k={result['k']}{' adaptive' if result['adaptive'] else ''}"
    table.add_row(f"spec={result['spec']}", f"{result['draft']}, {k}", f"{result['spec_tokens_per_s']:.1f}",
                  f"{result['acceptance_rate']:.2f}", f"{result['mean_accepted']:.2f}",
                  f"{result['tokens_per_target_pass']:.2f}", f"{result['draft_s']:.2f}", f"{result['verify_s']:.2f}")
    console.print(table)
    console.print(f"speedup vs no speculation: [bold]{result['speedup_vs_nospec']:.2f}x[/] end to end, "
                  f"{result['decode_speedup_vs_nospec']:.2f}x after the first token | identical outputs: "
                  f"{result['identical_outputs']} ({result['identical_runs']} runs)")
    console.print(f"kept drafted tokens per round (histogram): {result['accepted_histogram']}", style="dim")
    theirs = result.get("llamacpp", {})
    if "decode_tokens_per_s" in theirs:
        console.print(f"llama.cpp without speculation ({theirs['dtype']}): decode "
                      f"{theirs['decode_tokens_per_s']:.1f} tok/s, TTFT {theirs['ttft_ms']:.0f} ms | ours with "
                      f"spec={result['spec']}: [bold]{result['speedup_vs_llamacpp']:.2f}x[/] its decode, TTFT "
                      f"{result['ttft_speedup_vs_llamacpp']:.2f}x")
    elif theirs:
        console.print(f"no llama.cpp row: {theirs['unavailable']}", style="yellow")
    if peer := result.get("peer_assisted"):
        console.print(f"peer, transformers on {peer['model']} {peer['dtype']}: assisted generation "
                      f"({_assisted_how(peer)}) {peer['assisted']['tokens_per_s']:.1f} tok/s vs its "
                      f"plain generate() {peer['generate']['tokens_per_s']:.1f} tok/s = "
                      f"{peer['speedup_vs_generate']:.2f}x | ours (spec) over its assisted: "
                      f"[bold]{result['spec_tokens_per_s'] / peer['assisted']['tokens_per_s']:.2f}x[/] | identical "
                      f"outputs: {peer['identical_outputs']}")


def _assisted_how(peer: dict) -> str:
    if "draft" in peer:
        settings = ", ".join(f"{k}={v}" for k, v in peer["assistant_settings"].items())
        return f"assistant_model={peer['draft']}, {settings}"
    return f"prompt_lookup_num_tokens={peer['k']}"
