"""The lean forward against transformers' forward, side by side in one run (toolkit/engine/lean_forward.py).

    python -m benchmarks.forward [--model smollm2-135m] [--rounds 5] [--steps 20] [--threads N]

Three copies of the model are loaded as the engine runs them: one with `engine.forward=transformers`, one with
`engine.forward=lean`, and a lean one that leaves sdpa to transformers (which copies each key/value head per query
head in masked passes, where the lean forward shares them: `sdpa_gqa`). Each round times, on each copy in turn (so
all see the same machine noise), a 1-row decode
step (median of `steps`) and passes of 5 and 9 new tokens on a filled cache (a speculative verify's shape; cropped
back after each). Then, for layer 0, the fused fbgemm packs against the separate layers they replace: one 1-row call
each, best of many. Prints medians over rounds and the ratios; the logits of the copies are compared too.
"""

import statistics
import time

import torch

from benchmarks._cli import parser as script_parser
from toolkit.engine.fused_packs import fused_pack
from toolkit.model_state import peek

PROMPT_TOKENS = 128
PASS_ROWS = (1, 5, 9)


FORWARDS = ("transformers", "lean-copied-kv", "lean")


def _engine(model: str, forward: str, threads: int | None):
    from toolkit.engine.setup import default_engine_config, load_engine_model

    cfg = default_engine_config(threads=threads, forward="lean" if forward.startswith("lean") else forward)
    loaded = load_engine_model(model, cfg).model
    if forward == "lean-copied-kv" and peek(loaded).forward == "lean":
        loaded.forward.share_kv_heads = False
    return loaded


def _pass_ms(model, cache, rows: int, steps: int, generator) -> tuple[float, torch.Tensor]:
    """Median ms of a pass feeding `rows` new tokens after the cache's filled prefix (cropped back each time)."""
    base = cache.get_seq_length()
    vocab = model.config.vocab_size
    times, logits = [], None
    for _ in range(steps):
        ids = torch.randint(4, vocab, (1, rows), generator=generator)
        start = time.perf_counter()
        logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=rows).logits
        times.append(time.perf_counter() - start)
        cache.crop(base)
    return statistics.median(times) * 1e3, logits


def _call_us(f, reps: int = 300) -> float:
    for _ in range(20):
        f()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e6


@torch.inference_mode()
def run(model_name: str, rounds: int, steps: int, threads: int | None) -> dict:
    from toolkit.kv.contiguous import ContiguousKVCache

    models = {name: _engine(model_name, name, threads) for name in FORWARDS}
    if peek(models["lean"]).forward != "lean":
        raise SystemExit(f"{model_name}: the lean forward does not apply to this model")
    prompt = torch.randint(4, models["lean"].config.vocab_size, (1, PROMPT_TOKENS),
                           generator=torch.Generator().manual_seed(0))
    caches = {}
    for name, model in models.items():
        caches[name] = ContiguousKVCache.for_model(model, PROMPT_TOKENS + max(PASS_ROWS) + 1)
        model(input_ids=prompt, cache=caches[name], use_cache=True, logits_to_keep=1)
    times = {(name, rows): [] for name in models for rows in PASS_ROWS}
    worst = 0.0
    for r in range(rounds):
        order = list(models) if r % 2 == 0 else list(models)[::-1]
        for rows in PASS_ROWS:
            logits = {}
            for name in order:  # the same token ids for every copy: one generator seed per (round, rows)
                ms, logits[name] = _pass_ms(models[name], caches[name], rows, steps,
                                            torch.Generator().manual_seed(1000 * r + rows))
                times[(name, rows)].append(ms)
            worst = max(worst, *((logits[name] - logits["transformers"]).abs().max().item() for name in logits))

    lean, ref = models["lean"].model.layers[0], models["transformers"].model.layers[0]
    x = torch.randn(1, lean.self_attn.q_proj.in_features)
    fused = {}
    for label, pack, separate in (("q,k,v", fused_pack(lean.self_attn, "qkv"),
                                   (ref.self_attn.q_proj, ref.self_attn.k_proj, ref.self_attn.v_proj)),
                                  ("gate,up", fused_pack(lean.mlp, "gate_up"), (ref.mlp.gate_proj, ref.mlp.up_proj))):
        if pack is None:
            continue
        fused[label] = {"fused_us": _call_us(lambda: pack.run(x)),
                        "separate_us": _call_us(lambda: [layer(x) for layer in separate]),
                        "shape": f"{sum(pack.sizes)}x{x.shape[-1]}"}
    medians = {f"{name}_{rows}_rows_ms": statistics.median(v) for (name, rows), v in times.items()}
    return {"model": model_name, "threads": torch.get_num_threads(), "rounds": rounds, "steps": steps,
            **medians, "max_abs_logit_difference": worst, "fused": fused}


def print_result(out: dict) -> None:
    print(f"{out['model']}, {out['threads']} threads, {out['rounds']} rounds x {out['steps']} passes, "
          f"{PROMPT_TOKENS}-token cache; median ms per pass")
    print(f"{'new tokens per pass':22s}{'transformers':>14s}{'lean, copied kv':>17s}{'lean':>8s}"
          f"{'transformers/lean':>19s}{'copied kv/lean':>16s}")
    for rows in PASS_ROWS:
        a, b, c = (out[f"{name}_{rows}_rows_ms"] for name in FORWARDS)
        print(f"{rows:<22d}{a:14.1f}{b:17.1f}{c:8.1f}{a / c:18.2f}x{b / c:15.2f}x")
    print(f"largest |logit difference| from transformers' forward: {out['max_abs_logit_difference']:.2e}")
    for label, f in out["fused"].items():
        print(f"layer 0 {label}: fused {f['shape']} {f['fused_us']:.1f} us vs separate {f['separate_us']:.1f} us "
              f"({f['separate_us'] / f['fused_us']:.2f}x), 1 row, best of 5 x 300 calls")


def main(argv=None) -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    print_result(run(args.model, args.rounds, args.steps, args.threads))


if __name__ == "__main__":
    main()
