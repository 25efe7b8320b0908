"""Where a short prompt's time to first token goes: the engine's prefill of one N-token prompt, profiled function by
function (cProfile, so the native stack's C call shows as one entry), with the setup around it (tokenizing, the
cache) timed apart.

    python -m benchmarks.ttft_profile --model smollm2-135m --tokens 128 --rounds 20
    python -m benchmarks.ttft_profile --model CK --native-dot int8

Prints the median wall time of each phase over the rounds, then the functions that hold the prefill's time (own
time, and cumulative), so what is not arithmetic stands out (docs/engine.md, "Where a short prompt's time goes").
"""

import cProfile
import pstats
import statistics
import time

import torch

from benchmarks._cli import parser
from toolkit.engine import ContiguousKVCache
from toolkit.engine.generate import prefill
from toolkit.engine.native_decoder import phase_timing
from toolkit.engine.setup import default_engine_config, load_engine_model


def _prompt(tokenizer, tokens: int) -> list[int]:
    import pydoc_data.topics

    text = " ".join(pydoc_data.topics.topics.values())
    return tokenizer(text[:tokens * 8]).input_ids[:tokens]


def run(model_name: str, tokens: int, rounds: int, native_dot: str = "fp32") -> dict:
    loaded = load_engine_model(model_name, default_engine_config(native_dot=native_dot))
    model, tokenizer = loaded.model, loaded.tokenizer
    text = tokenizer.decode(_prompt(tokenizer, tokens))
    phases: dict[str, list[float]] = {"tokenize": [], "cache": [], "prefill": [], "argmax": []}

    def once():
        t0 = time.perf_counter()
        ids = torch.tensor([tokenizer(text).input_ids[:tokens]])
        t1 = time.perf_counter()
        cache = ContiguousKVCache.for_model(model, ids.shape[1] + 64)
        t2 = time.perf_counter()
        positions = torch.arange(ids.shape[1])[None]
        logits = prefill(model, ids, None, positions, cache)
        t3 = time.perf_counter()
        int(logits[0, -1].argmax()) if logits.dim() == 3 else int(logits[0].argmax())
        t4 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3

    for _ in range(3):
        once()  # packs, kernels and caches built on first use
    for _ in range(rounds):
        for name, seconds in zip(phases, once()):
            phases[name].append(seconds)
    phase_timing(True)
    for _ in range(rounds):
        once()
    stack = {k: v / rounds * 1e3 for k, v in phase_timing(False).items()}
    profile = cProfile.Profile()
    ids = torch.tensor([tokenizer(text).input_ids[:tokens]])
    positions = torch.arange(ids.shape[1])[None]
    for _ in range(rounds):
        cache = ContiguousKVCache.for_model(model, ids.shape[1] + 64)
        profile.enable()
        prefill(model, ids, None, positions, cache)
        profile.disable()
    return {"model": loaded.name, "precision": loaded.precision.name, "tokens": int(ids.shape[1]), "rounds": rounds,
            "median_ms": {k: statistics.median(v) * 1e3 for k, v in phases.items()}, "stack_ms": stack,
            "profile": profile}


def print_result(result: dict, top: int = 18) -> None:
    med = result["median_ms"]
    total = sum(med.values())
    print(f"{result['model']} ({result['precision']}), {result['tokens']}-token prompt, medians of {result['rounds']}")
    for name, ms in med.items():
        print(f"  {name:<9} {ms:8.2f} ms  {100 * ms / total:5.1f}%")
    print(f"  {'total':<9} {total:8.2f} ms")
    if any(result["stack_ms"].values()):
        print("inside the native stack (means):")
        for name, ms in result["stack_ms"].items():
            print(f"  {name:<24} {ms:8.2f} ms  {100 * ms / med['prefill']:5.1f}% of the prefill")
    print("\nthe prefill by function (all rounds; tottime = own time, cumtime = with callees):")
    pstats.Stats(result["profile"]).strip_dirs().sort_stats("tottime").print_stats(top)


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--native-dot", default="fp32", choices=["fp32", "bf16", "int8"])
    args = p.parse_args(argv)
    print_result(run(args.model, args.tokens, args.rounds, args.native_dot))


if __name__ == "__main__":
    main()
