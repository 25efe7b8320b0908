"""What one forward pass feeding r new tokens onto a filled cache costs, per product setting, side by side in one run.

    python -m benchmarks.rowcost [--model smollm2-135m] [--rows 1 2 4 6 9 12 17 128] [--rounds 9] [--passes 10]

A decode step is r = 1; a speculative verify pass of k drafted tokens is r = k + 1; a prompt is r = its length. The
ratio of an r-row pass to a one-row step is what speculative decoding pays for each verify, so it, more than the
step itself, decides the speedup a draft's acceptance can buy. Settings, each the engine as `specquant bench` loads
it: `fp32` (engine.native_dot=fp32: fp16 weights x fp32 activations), `bf16` (engine.native_dot=bf16 on
vdpbf16ps) and, where the CPU has AMX-BF16, `bf16-amx` (the same packs on the tile unit,
`toolkit.quant.bf16_native.set_amx`). Two copies of the model are loaded (the fp32 and bf16 packs); the bf16 ones
switch paths between timings. Each round times every setting at every r in turn (so all see the same machine
noise), `passes` passes each on a `--context`-token cache cropped back after each; the table gives medians over
rounds and, per setting, the pass in one-row steps, with the machine's bandwidth measured after the timings; the
`bf16-amx` rows appear only where the tile path runs.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks._cli import parser as script_parser


def _load(model: str, dot: str):
    from toolkit.engine.setup import default_engine_config, load_engine_model

    return load_engine_model(model, default_engine_config(native_dot=dot)).model


def run(model: str, rows: list[int], rounds: int, passes: int, context: int) -> dict:
    from toolkit.kv.contiguous import ContiguousKVCache
    from toolkit.machine import measure_memory_bandwidth
    from toolkit.quant import bf16_native

    models = {"fp32": _load(model, "fp32"), "bf16": _load(model, "bf16")}
    settings = [("fp32", "fp32", False), ("bf16", "bf16", False)]
    amx_before = bf16_native.amx_in_use()
    if bf16_native.set_amx(True):
        settings.append(("bf16-amx", "bf16", True))
    ids = torch.randint(4, models["fp32"].config.vocab_size, (1, context + max(rows)),
                        generator=torch.Generator().manual_seed(0))
    times = {name: {r: [] for r in rows} for name, _, _ in settings}
    try:
        with torch.inference_mode():
            caches = {}
            for key, m in models.items():
                caches[key] = ContiguousKVCache.for_model(m, context + max(rows) + 1)
                m.forward(input_ids=ids[:, :context], cache=caches[key], use_cache=True)
            for _ in range(rounds):
                for r in rows:
                    for name, key, amx in settings:
                        bf16_native.set_amx(amx)
                        m, cache = models[key], caches[key]
                        start = time.perf_counter()
                        for _ in range(passes):
                            cache.crop(context)
                            m.forward(input_ids=ids[:, context:context + r], cache=cache, use_cache=True)
                        times[name][r].append((time.perf_counter() - start) / passes * 1e3)
    finally:
        bf16_native.set_amx(amx_before)
    ms = {name: {r: statistics.median(v) for r, v in per.items()} for name, per in times.items()}
    return {"model": model, "context": context, "rounds": rounds, "passes": passes, "ms": ms,
            "steps": {name: {r: v / per[rows[0]] for r, v in per.items()} for name, per in ms.items()},
            "memory_bandwidth_gbs": measure_memory_bandwidth() / 1e9}


def print_result(result: dict) -> None:
    rows = list(next(iter(result["ms"].values())))
    print(f"{result['model']}: one pass of r new tokens on a {result['context']}-token cache, median ms over "
          f"{result['rounds']} rounds x {result['passes']} (bandwidth {result['memory_bandwidth_gbs']:.1f} GB/s)")
    print(f"{'r':>18}" + "".join(f"{r:>9}" for r in rows))
    for name, per in result["ms"].items():
        print(f"{name + ', ms':>18}" + "".join(f"{per[r]:>9.2f}" for r in rows))
        print(f"{'  in 1-row steps':>18}" + "".join(f"{result['steps'][name][r]:>9.2f}" for r in rows))


def main(argv: list[str] | None = None) -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 9, 12, 17, 128])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args(argv)
    if args.rows[0] != 1:
        parser.error("--rows must start with 1 (the one-row step the others are counted in)")
    print_result(run(args.model, args.rows, args.rounds, args.passes, args.context))


if __name__ == "__main__":
    main()
