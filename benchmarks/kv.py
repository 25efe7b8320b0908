"""The quantized KV cache measured: memory, long-context quality, decode latency, side by side in one run.

    python -m benchmarks.kv [--parts memory quality itl] [--group 128] [--residual 32] [--windows 2]
                            [--chunk 128] [--contexts 2048 8128] [--steps 16] [--baselines] [--out FILE]

memory   bytes of the cache at 2048 and 8192 tokens for SmolLM2's shape (30 layers, 3 KV heads, head dim 64), batch 1,
         residual in bf16, as a ratio to a bf16 cache: the formula (toolkit.kv.memory) and the real bytes of one layer
         filled with random bf16 keys/values (its `nbytes`, the tensors' filled slices) x 30, with and without the
         crop shadow, for group 32/128 x residual 32/128 x int8/int4/int2.
quality  perplexity over 2048-token windows of austen's evaluation split (BOS first, then 2047 text tokens,
         consecutive non-overlapping windows), every position after the first scored. Each window is fed through
         the cache `--chunk` tokens at a time (prefill of a chunk, then the next), so every chunk attends to the
         earlier ones as the cache stores them: tokens older than the residual window are read back quantized,
         as decode reads them. KL(fp || kind) and top-1 agreement against the fp cache fed the same chunks.
itl      decode inter-token latency at each context: one fp prefill, its keys/values loaded into every cache (the
         state a prefill leaves), then greedy decode steps interleaved across caches (step i of every cache before
         step i+1 of any), median per cache and ratio to fp; greedy agreement with fp over the steps.
Caches: int8, int4, int2 with the defaults of conf/kv (kv.rollback 1: no speculation here), and int4-base, int2-base:
         the same caches without the sink token, pre-RoPE keys and value clip (the ablation, in the same run).
         In itl also <kind>-torch: the same caches read with torch ops instead of the fused kernel (kv.dequant=torch:
         bit-equal values, so only their time is shown), and int4-cached (a float copy: what dequantizing costs).
--baselines adds transformers' QuantizedCache (quanto int4/int2, hqq int8/int4/int2, same group and residual,
         library default axes) to quality and itl.
Model: SmolLM2-135M in fp32 (the KV dtype is the activations'). Timings are only comparable within one run.
"""

import argparse
import statistics
import time

import torch

from toolkit.kv import KVSpec, make_kv_cache
from toolkit.kv.contiguous import ContiguousKVCache
from toolkit.kv.memory import bf16_kv_bytes, quantized_kv_bytes

SMOLLM2 = {"layers": 30, "kv_heads": 3, "head_dim": 64}
KINDS = ("int8", "int4", "int2")
# `<kind>-base`: the same cache without what we add at low bits (sink token, pre-RoPE keys, value clip)
WITHOUT_ADDITIONS = {"sink": 0, "pre_rope": False, "value_clip": False}
HF_BASELINES = (("quanto", 4), ("quanto", 2), ("hqq", 8), ("hqq", 4), ("hqq", 2))


def memory_table() -> list[dict]:
    rows = []
    for tokens in (2048, 8192):
        k = torch.randn(1, 3, tokens, 64, dtype=torch.bfloat16)
        for group in (32, 128):
            for residual in (32, 128):
                for kind in KINDS:
                    for shadow in (True, False):
                        cfg = {"kind": kind, "group_size": group, "residual": residual, "crop_shadow": shadow,
                               "pre_rope": False}  # no model here to read the rotation from; bytes are the same
                        kv = KVSpec.from_node(cfg)
                        formula = quantized_kv_bytes(kv.quant, tokens, batch=1, residual_bytes=2, **SMOLLM2)
                        cache = make_kv_cache(_Shape(), tokens, kv)
                        cache.update(k, k, 0)  # every layer holds the same shapes: fill one, count it 30 times
                        real = cache.layers[0].nbytes * SMOLLM2["layers"]
                        bf16 = bf16_kv_bytes(tokens, batch=1, **SMOLLM2)
                        rows.append({"tokens": tokens, "kind": kind, "group": group, "residual": residual,
                                     "shadow": shadow, "formula_bytes": formula, "real_bytes": real,
                                     "ratio_to_bf16": real / bf16})
    return rows


class _Shape:
    """Just enough of a model for make_kv_cache: its layer count."""

    class config:  # noqa: N801
        @staticmethod
        def get_text_config(decoder=True):
            return type("C", (), {"num_hidden_layers": SMOLLM2["layers"]})


def _hf_cache(model, backend: str, bits: int, group: int, residual: int):
    from transformers.cache_utils import QuantizedCache

    return QuantizedCache(backend, model.config, nbits=bits, q_group_size=group, residual_length=residual)


def _caches(model, names: list[str], length: int, group: int, residual: int) -> dict:
    out = {}
    for name in names:
        if name == "fp":
            out[name] = ContiguousKVCache.for_model(model, length)
        elif name.startswith(("quanto", "hqq")):
            backend, bits = name.split("-int")
            out[name] = _hf_cache(model, backend, int(bits), group, residual)
        else:
            kind, _, mode = name.partition("-")
            extra = WITHOUT_ADDITIONS if mode == "base" else {"dequant": mode or "full"}
            kv = KVSpec.from_node({"kind": kind, "group_size": group, "residual": residual, **extra})
            out[name] = make_kv_cache(model, length, kv)
    return out


def _windows(tokenizer, windows: int, size: int) -> list[list[int]]:
    from toolkit.data import load_text

    text = "\n\n".join(load_text("austen", "evaluation")["text"])
    ids = tokenizer(text, add_special_tokens=False).input_ids
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    body = size - 1
    if len(ids) < windows * body:
        raise SystemExit(f"austen evaluation has {len(ids)} tokens: ask for fewer windows")
    return [[bos] + ids[i * body:(i + 1) * body] for i in range(windows)]


@torch.inference_mode()
def quality(model, tokenizer, names: list[str], windows: int, size: int, chunk: int, group: int,
            residual: int) -> dict:
    stats = {n: {"nll": 0.0, "kl": 0.0, "top1": 0.0} for n in names}
    count = 0
    for ids in _windows(tokenizer, windows, size):
        ids = torch.tensor([ids])
        caches = _caches(model, ["fp"] + names, size, group, residual)
        for start in range(0, size, chunk):
            piece = ids[:, start:start + chunk]
            pos = torch.arange(start, start + piece.shape[1])[None]
            logp = {n: model(input_ids=piece, position_ids=pos, cache=c, use_cache=True).logits.float().log_softmax(-1)
                    for n, c in caches.items()}
            target = ids[:, start + 1:start + 1 + piece.shape[1]]  # the next token of each position
            m = target.shape[1]
            ref = logp["fp"][:, :m]
            for n in ["fp"] + names:
                st = stats.setdefault(n, {"nll": 0.0, "kl": 0.0, "top1": 0.0})
                got = logp[n][:, :m]
                st["nll"] += -got.gather(-1, target[..., None]).sum().item()
                st["kl"] += (ref.exp() * (ref - got)).sum(-1).sum().item()
                st["top1"] += (got.argmax(-1) == ref.argmax(-1)).sum().item()
            count += m
    fp_ppl = float(torch.tensor(stats["fp"]["nll"] / count).exp())
    out = {}
    for n, st in stats.items():
        ppl = float(torch.tensor(st["nll"] / count).exp())
        out[n] = {"perplexity": ppl, "ppl_change_pct": (ppl / fp_ppl - 1) * 100, "kl": st["kl"] / count,
                  "top1_agreement": st["top1"] / count}
    out["protocol"] = {"windows": windows, "window_tokens": size, "chunk": chunk, "scored_tokens": count,
                       "group": group, "residual": residual}
    return out


@torch.inference_mode()
def itl(model, tokenizer, names: list[str], context: int, steps: int, group: int, residual: int) -> dict:
    ids = torch.tensor([_windows(tokenizer, 1, context)[0]])
    fp = ContiguousKVCache.for_model(model, context + steps)
    for start in range(0, context, 512):  # prefill in chunks: bounded attention memory at 8k
        piece = ids[:, start:start + 512]
        logits = model(input_ids=piece, position_ids=torch.arange(start, start + piece.shape[1])[None], cache=fp,
                       use_cache=True, logits_to_keep=1).logits
    first = logits[:, -1].argmax(-1)
    caches = _caches(model, names, context + steps, group, residual)
    for cache in caches.values():  # the state a one-shot prefill leaves in each cache
        for i, layer in enumerate(fp.layers):
            cache.update(layer.keys.clone(), layer.values.clone(), i)
    caches = {"fp": fp, **caches}
    tokens = {n: first.clone() for n in caches}
    times = {n: [] for n in caches}
    chosen = {n: [] for n in caches}
    for step in range(steps):
        pos = torch.tensor([[context + step]])
        order = list(caches) if step % 2 == 0 else list(reversed(caches))
        for n in order:
            t0 = time.perf_counter()
            logits = model(input_ids=tokens[n][:, None], position_ids=pos, cache=caches[n], use_cache=True).logits
            tokens[n] = logits[:, -1].argmax(-1)
            times[n].append(time.perf_counter() - t0)
            chosen[n].append(int(tokens[n]))
    fp_ms = statistics.median(times["fp"]) * 1e3
    out = {}
    for n in caches:
        ms = statistics.median(times[n]) * 1e3
        agree = sum(a == b for a, b in zip(chosen[n], chosen["fp"])) / steps
        out[n] = {"itl_ms_p50": ms, "ratio_to_fp": ms / fp_ms, "greedy_agreement_vs_fp": agree}
    out["protocol"] = {"context": context, "steps": steps, "group": group, "residual": residual}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["memory", "quality", "itl"])
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--residual", type=int, default=32)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--window-tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8128])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--baselines", action="store_true")
    parser.add_argument("--kinds", nargs="+", help="caches to compare with fp (default: int8 int4 int2 [+ baselines])")
    parser.add_argument("--no-cached", action="store_true", help="skip the int4 float-copy path in itl")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"args": vars(args)}
    if "memory" in args.parts:
        result["memory"] = memory_table()
        print("memory (SmolLM2 shape, batch 1, bf16 residual): ratio to a bf16 cache, real bytes (= formula?)")
        for r in result["memory"]:
            print(f"  {r['tokens']:>5} tok {r['kind']} g{r['group']:<3} r{r['residual']:<3} shadow={r['shadow']!s:5} "
                  f"{r['ratio_to_bf16']:.3f}x  formula==real: {r['formula_bytes'] == r['real_bytes']}", flush=True)
    names = list(KINDS) + ["int4-base", "int2-base"]
    if args.baselines:
        names += [f"{b}-int{bits}" for b, bits in HF_BASELINES]
    names = args.kinds or names
    if "quality" in args.parts or "itl" in args.parts:
        from toolkit.models import load_model

        loaded = load_model("smollm2-135m", dtype=torch.float32)
        model, tok = loaded.model, loaded.tokenizer
    if "quality" in args.parts:
        q = quality(model, tok, names, args.windows, args.window_tokens, args.chunk, args.group, args.residual)
        result["quality"] = q
        print(f"quality: {q['protocol']}")
        for n, r in q.items():
            if n != "protocol":
                print(f"  {n:12} ppl {r['perplexity']:.3f} ({r['ppl_change_pct']:+.2f}%)  KL {r['kl']:.5f}  "
                      f"top-1 {r['top1_agreement']:.4f}", flush=True)
    if "itl" in args.parts:
        result["itl"] = []
        for context in args.contexts:
            extra = ([] if args.no_cached else ["int4-cached"]) + ([] if args.kinds else [f"{k}-torch" for k in KINDS])
            r = itl(model, tok, names + extra, context, args.steps, args.group, args.residual)
            result["itl"].append(r)
            print(f"itl: {r['protocol']}")
            for n, v in r.items():
                if n != "protocol":
                    print(f"  {n:12} {v['itl_ms_p50']:.1f} ms  {v['ratio_to_fp']:.2f}x fp  greedy agreement "
                          f"{v['greedy_agreement_vs_fp']:.3f}", flush=True)
    if args.out:
        from toolkit.fileio import write_json_atomic

        write_json_atomic(args.out, result)


if __name__ == "__main__":
    main()
