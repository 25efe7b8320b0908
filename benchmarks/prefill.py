"""Prompt passes in bf16 against fp32, side by side in one run (`engine.prefill_dtype`, toolkit/engine/precision.py).

    python -m benchmarks.prefill [--model smollm2-135m] [--lengths 128,512,1024] [--prompts 3] [--rounds 3]
                                 [--new-tokens 32]

The model is loaded twice as the engine runs it, with `engine.prefill_dtype=fp32` and `=bf16`. For each prompt
length, each round times the engine's prefill (`engine.generate.prefill`: a fresh cache, logits of the last
position) of every prompt on each copy in turn, so both see the same machine noise; medians over rounds and
prompts, and their ratio. Quality, per prompt: KL(fp32 || bf16) and top-1 agreement of the next-token
distribution after the prompt, and whether the two copies' greedy continuations of `new_tokens` tokens are the same
(decode steps are exact in both, so a difference there comes from the prompt's keys and values alone). For scale,
the KL that the engine's fp16 weight storage itself costs (fp32 products, against a copy with fp32 weights). Prompts are
windows of the held-out `open` prompt set's source (`toolkit.data.build_prompts`), never calibration text.
"""

import statistics
import time

import torch

from benchmarks._cli import parser as script_parser


def _engine(model: str, prefill: str, dtype: str = "auto"):
    from toolkit.engine.setup import default_engine_config, load_engine_model

    return load_engine_model(model, default_engine_config(prefill_dtype=prefill, dtype=dtype))


def _prefill(model, ids: list[int]) -> tuple[float, torch.Tensor]:
    from toolkit.engine.generate import prefill
    from toolkit.kv.contiguous import ContiguousKVCache

    cache = ContiguousKVCache.for_model(model, len(ids) + 1)
    start = time.perf_counter()
    logits = prefill(model, torch.tensor([ids]), None, None, cache)
    return time.perf_counter() - start, logits[0]


def run(model_name: str, lengths: list[int], n_prompts: int, rounds: int, new_tokens: int) -> dict:
    from toolkit.data import build_prompts
    from toolkit.engine.generate import generate

    models = {name: _engine(model_name, name) for name in ("fp32", "bf16")}
    if models["bf16"].precision.prefill != "bf16":
        raise SystemExit(f"{model_name}: bf16 prompt passes do not apply here (a CPU without native bf16, or a "
                         "model whose weights are not half-stored under fp32 activations)")
    full = _engine(model_name, "fp32", dtype="fp32").model  # fp32 weights: the scale of fp16 storage's own error
    tokenizer = models["fp32"].tokenizer
    rows = []
    for length in lengths:
        prompts = [tokenizer(p.text).input_ids for p in build_prompts("open", tokenizer, length, n_prompts)]
        times = {name: [] for name in models}
        for _ in range(rounds):
            for ids in prompts:
                for name, loaded in models.items():
                    times[name].append(_prefill(loaded.model, ids)[0])
        kl, kl_storage, top1, same = [], [], [], []
        for ids in prompts:
            logits = {name: _prefill(loaded.model, ids)[1] for name, loaded in models.items()}
            p, q = logits["fp32"].log_softmax(-1), logits["bf16"].log_softmax(-1)
            kl.append(float((p.exp() * (p - q)).sum()))
            r = _prefill(full, ids)[1].log_softmax(-1)
            kl_storage.append(float((r.exp() * (r - p)).sum()))
            top1.append(int(p.argmax() == q.argmax()))
            outs = [generate(loaded.model, tokenizer, [ids], new_tokens).sequences[0].token_ids
                    for loaded in models.values()]
            same.append(int(outs[0] == outs[1]))
        fp32, bf16 = (statistics.median(times[n]) * 1e3 for n in ("fp32", "bf16"))
        rows.append({"prompt_tokens": statistics.mean(len(ids) for ids in prompts), "fp32_ms": fp32, "bf16_ms": bf16,
                     "speedup": fp32 / bf16, "kl": statistics.mean(kl),
                     "kl_fp16_storage": statistics.mean(kl_storage), "top1": statistics.mean(top1),
                     "same_continuations": sum(same), "prompts": len(prompts)})
    return {"model": models["fp32"].name, "rounds": rounds, "new_tokens": new_tokens, "rows": rows}


def print_result(out: dict) -> None:
    print(f"{out['model']}: engine prefill, fp32 against bf16 products (median of {out['rounds']} rounds x prompts)")
    print(f"{'prompt tokens':>14s} {'fp32 ms':>9s} {'bf16 ms':>9s} {'speedup':>8s} {'KL':>9s} {'top-1':>6s} "
          f"{'same ' + str(out['new_tokens']) + '-token continuations':>30s} {'KL of fp16 storage':>19s}")
    for r in out["rows"]:
        print(f"{r['prompt_tokens']:14.0f} {r['fp32_ms']:9.1f} {r['bf16_ms']:9.1f} {r['speedup']:7.2f}x "
              f"{r['kl']:9.2e} {r['top1']:6.2f} {r['same_continuations']:>24d} / {r['prompts']:<3d} "
              f"{r['kl_fp16_storage']:19.2e}")
    print("KL, top-1: the next token after the prompt, bf16 prompt products against fp32 ones; KL of fp16 storage: "
          "fp32 prompt products with the engine's fp16 weights against fp32 weights (engine.dtype=fp32), for scale")


def main(argv=None) -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--lengths", default="128,512,1024")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    print_result(run(args.model, [int(n) for n in args.lengths.split(",")], args.prompts, args.rounds,
                     args.new_tokens))


if __name__ == "__main__":
    main()
