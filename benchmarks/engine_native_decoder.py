"""The native decoder against the lean forward's torch operators over the same loaded model: a decode step and 5-
and 9-token passes (speculative verifies) on a 128-token cache, alternating, median ms per pass
(toolkit/engine/native_decoder.py). Run from the repository root, with a model the native decoder runs:

    python benchmarks/engine_native_decoder.py [MODEL]

(default: the SmolLM2 GPTQ w4g64 checkpoint under $SPECQUANT_HOME/checkpoints).
"""

import sys
import time

import torch

from toolkit.engine.lean_forward import LeanForward
from toolkit.engine.setup import default_engine_config, load_engine_model
from toolkit.kv.contiguous import ContiguousKVCache
from toolkit.model_state import peek
from toolkit.paths import home


def bench(model: str, context: int = 128, rounds: int = 5, passes: int = 20) -> None:
    """A decode step and 5- and 9-token passes (speculative verifies) on a `context`-token cache, the native decoder
    against the lean forward's torch operators over the same loaded model, alternating (median ms per pass)."""
    loaded = load_engine_model(model, default_engine_config())
    m = loaded.model
    if peek(m).forward != "native":
        raise SystemExit(f"{model}: the native decoder does not run this model ({m.forward.native_reason})")
    forwards = {"native": m.forward, "torch ops": LeanForward(m, native=False)}
    ids = torch.randint(4, m.config.vocab_size, (1, context + 9), generator=torch.Generator().manual_seed(0))
    print(f"{loaded.name}, {loaded.precision.name}, {torch.get_num_threads()} threads, {context}-token cache; "
          f"median ms per pass of {rounds} rounds x {passes}")
    print(f"{'new tokens':>10} {'lean, torch ops':>16} {'native':>8} {'ratio':>7}")
    with torch.inference_mode():
        caches = {}
        for name, forward in forwards.items():
            caches[name] = ContiguousKVCache.for_model(m, context + 16)
            forward(input_ids=ids[:, :context], cache=caches[name], use_cache=True)
        for n in (1, 5, 9):
            times = {name: [] for name in forwards}
            for _ in range(rounds):
                for name, forward in forwards.items():
                    cache = caches[name]
                    start = time.perf_counter()
                    for _ in range(passes):
                        cache.crop(context)
                        forward(input_ids=ids[:, context:context + n], cache=cache, use_cache=True)
                    times[name].append((time.perf_counter() - start) / passes * 1e3)
            lean, native = (sorted(times[k])[rounds // 2] for k in ("torch ops", "native"))
            print(f"{n:>10} {lean:>16.2f} {native:>8.2f} {lean / native:>6.2f}x")


if __name__ == "__main__":
    bench(sys.argv[1] if len(sys.argv) > 1 else str(home() / "checkpoints" / "smollm2-135m-gptq-w4g64"))
