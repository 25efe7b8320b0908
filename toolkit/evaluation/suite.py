"""Run the quality tasks on a candidate model against its reference and collect figures with their protocols.

Tasks: `ppl` (perplexity), `kl` (KL divergence and top-1 agreement; same windows and passes as ppl, so asking for
either computes both), `cloze`, `mc`, `gen`. A full-precision KV cache in the activations' dtype hands back exactly
what was stored, so with kv=fp perplexity windows run as plain forward passes; with a quantized kind, or
kv.dtype=fp16 or bf16 (a narrower store), they are fed `chunk` tokens at a time. Cloze/mc passages are prefilled
into the cache once and their continuations read them back, whatever the kind (see forward.py, continuation.py)."""

import time
from dataclasses import asdict, dataclass

from tqdm import tqdm

from toolkit.engine.precision import runs_int8_activations
from toolkit.errors import InputError
from toolkit.evaluation.choice import score_choice
from toolkit.evaluation.cloze import score_cloze
from toolkit.evaluation.generation import gen_prompts, score_generation
from toolkit.evaluation.items import load_items, spread
from toolkit.evaluation.perplexity import score_windows
from toolkit.evaluation.windows import make_windows
from toolkit.kv import KVSpec, kv_spec

TASKS = ("ppl", "kl", "cloze", "mc", "gen")


@dataclass
class Settings:
    window: int = 512
    max_windows: int | None = 32  # caps a long evaluation split (austen's Persuasion is ~200 windows)
    batch_size: int = 2  # windows per forward pass
    chunk: int | None = 128  # tokens per pass through a quantized KV cache; null: one pass (cache never read)
    items: int | None = 500  # cloze / mc items evaluated (evenly spread over all built); null: all
    max_context: int = 128  # passage tokens (BOS included) before a cloze target or mc ending
    item_batch_size: int = 16
    gen_prompts: int = 8
    gen_prompt_tokens: int = 64
    gen_new_tokens: int = 32


def resolve_tasks(task: str | list[str]) -> list[str]:
    names = list(TASKS) if task == "all" else ([task] if isinstance(task, str) else list(task))
    names = [n.strip() for name in names for n in str(name).split("+")]
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        raise InputError(f"unknown task {'+'.join(unknown) or task!r}",
                         f"use task= one of {', '.join(TASKS)}, all, or several joined by + (task=ppl+cloze)")
    return list(dict.fromkeys("ppl" if n == "kl" else n for n in names))


def run_tasks(model, tokenizer, texts: list[str], tasks: list[str], settings: Settings, reference=None,
              kv: KVSpec | None = None, data: str = "text", log=print, progress: bool = False) -> dict:
    """{"figures": flat dict of numbers, "protocol": {task: description dict}, "seconds": {task: wall time}}.
    reference=None: the model is its own reference. progress: tqdm bars on stderr."""
    kv = kv_spec(kv)
    kind = str(kv)
    # a quantized cache, a float one stored narrower on request (kv.dtype=fp16|bf16) or a windowed one changes the
    # outputs only where tokens are read back: feed the windows through it
    through_cache = kv.quantized or kv.dtype in ("fp16", "bf16") or bool(kv.window)
    if runs_int8_activations(model) and set(tasks) - {"ppl"}:
        # int8 activations exist on the native stack only (one sequence at a time): the item and generation tasks
        # batch their rows, which would score the exact path instead
        raise InputError("engine.native_dot=int8 is evaluated with task=ppl (perplexity, KL and top-1) only",
                         "use task=ppl, or engine.native_dot=fp32 for the other tasks")
    figures, protocol, seconds = {}, {}, {}
    reference_note = "its own (same model, fp cache)" if reference is None else "the reference model, fp KV cache"
    for task in tasks:
        start = time.perf_counter()
        if task == "ppl":
            windows, proto = make_windows(tokenizer, texts, settings.window, settings.max_windows, data)
            # at least two chunks per window, or a quantized cache would never be read back
            chunk = min(settings.chunk or settings.window, settings.window // 2) if through_cache else None
            proto = type(proto)(**{**asdict(proto), "chunk": chunk, "kv": kind})
            log(f"ppl/kl/top-1: {proto.describe()}")
            with tqdm(total=len(windows), desc="ppl", unit="window", leave=False, disable=not progress) as bar:
                figures.update(score_windows(model, windows, reference, kv, chunk, settings.batch_size,
                                             bar.update))
            protocol["ppl"] = {**proto.to_dict(), "reference": reference_note,
                               "kl": "KL(reference || candidate), nats per scored token, same windows"}
        elif task in ("cloze", "mc"):
            items, key = load_items(task, texts, data)
            chosen = spread(items, settings.items)
            scorer = score_cloze if task == "cloze" else score_choice
            describe = (f"{data}: {len(chosen)} of {len(items)} {task} items (content hash {key[:16]}), "
                        f"passages cut to {settings.max_context} tokens (BOS first), each passage prefilled once "
                        f"into the {kind} KV cache, its continuations fed behind it")
            residual = kv.residual if through_cache else 0
            if residual >= settings.max_context:
                describe += (f" (the passages fit the cache's full-precision residual window of {residual} tokens, "
                             f"so no quantized key or value is read: these scores are the fp cache's)")
            log(f"{task}: {describe}")
            rows = len(chosen) * (1 if task == "cloze" else len(chosen[0]["endings"])) * (1 + (reference is not None))
            with tqdm(total=rows, desc=task, unit="row", leave=False, disable=not progress) as bar:
                scored = scorer(model, tokenizer, chosen, reference, settings.max_context,
                                settings.item_batch_size, kv, bar.update)
            from_cache = scored.pop("ref_from_cache")
            figures.update(scored)
            protocol[task] = {"items": len(chosen), "built": len(items), "items_hash": key,
                              "max_context": settings.max_context, "kv": kind, "text": describe,
                              "reference": reference_note + (" (its scores read from the disk cache, see "
                                                             "toolkit.evaluation.reference_scores)" if from_cache
                                                             else "")}
        elif task == "gen":
            prompts = gen_prompts(tokenizer, texts, settings.gen_prompts, settings.gen_prompt_tokens)
            describe = (f"{data}: {len(prompts)} prompts x {settings.gen_prompt_tokens} tokens, "
                        f"{settings.gen_new_tokens} greedy tokens each through the engine (candidate KV cache: "
                        f"{kind}); stop tokens ignored")
            log(f"gen: {describe}")
            figures.update(score_generation(model, tokenizer, prompts, settings.gen_new_tokens, reference, kv))
            protocol["gen"] = {"prompts": len(prompts), "prompt_tokens": settings.gen_prompt_tokens,
                               "new_tokens": settings.gen_new_tokens, "kv": kind, "text": describe,
                               "reference": reference_note}
        seconds[task] = round(time.perf_counter() - start, 2)
    return {"figures": figures, "protocol": protocol, "seconds": seconds}
