"""Decode at long context with each KV cache the engine offers, interleaved step for step in one run: the float
cache stored in fp32 and in fp16 (`kv.dtype`), and the quantized kinds asked for. Prints each cache's ITL p50, the
bytes a step reads (weights + the cache as stored) and how far the step is above its bandwidth floor.

    python -m benchmarks.kv_store --contexts 4000 8000
    python -m benchmarks.kv_store --model ~/.cache/specquant/checkpoints/smollm2-135m-rtn-w4g64 --native-dot int8 \\
        --caches fp32 fp16 int8 int4 --out kv_store.json

Memory bandwidth moves from run to run on a shared machine (the floor with it); the ITL ratios between caches, all
measured in the same minutes, are the figures to compare. docs/kv-cache.md quotes them.
"""

import statistics

from benchmarks._cli import parser
from toolkit.engine.costs import weight_bytes_per_token
from toolkit.engine.generate import generate
from toolkit.engine.setup import load_engine_model
from toolkit.engine.spec import EngineSpec
from toolkit.fileio import write_json_atomic
from toolkit.kv import KVSpec
from toolkit.machine import machine_facts

CACHES = {"fp32": KVSpec(dtype="fp32"), "fp16": KVSpec(dtype="fp16"), "bf16": KVSpec(dtype="bf16"),
          "int8": KVSpec("int8"), "int4": KVSpec("int4"), "int2": KVSpec("int2"),
          # the fp16 cache keeping the first 4 and the last 2,048 to 2,304 tokens (kv.window; docs/kv-cache.md)
          "fp16-w2048": KVSpec(dtype="fp16", window=2048),
          "int4-w2048": KVSpec.from_node({"kind": "int4", "window": 2048})}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--native-dot", default="fp32", help="engine.native_dot (fp32, bf16, int8)")
    p.add_argument("--contexts", type=int, nargs="+", default=[4000, 8000], help="prompt tokens")
    p.add_argument("--caches", nargs="+", default=["fp32", "fp16"], choices=list(CACHES))
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args()
    facts = machine_facts()
    bandwidth = facts["memory_bandwidth_gbs"] * 1e9
    loaded = load_engine_model(args.model, EngineSpec(native_dot=args.native_dot))
    model, tokenizer = loaded.model, loaded.tokenizer
    weights = weight_bytes_per_token(model)
    rows = []
    for context in args.contexts:
        ids = [(i * 7919) % 40000 + 100 for i in range(context)]  # a fixed prompt; decode cost does not read it
        itl, kv_bytes = {c: [] for c in args.caches}, {}
        for rep in range(args.repeats):
            for name in args.caches if rep % 2 == 0 else reversed(args.caches):
                out = generate(model, tokenizer, [ids], args.new_tokens, stop_tokens=set(), kv=CACHES[name])
                itl[name] += out.timing.itl_s[4:]  # past the first steps' warm-up
                held = context + args.new_tokens - 1  # what a window holds stays about the same from step to step
                kv_bytes[name] = out.kv_bytes * (1 if CACHES[name].window else (context + args.new_tokens / 2) / held)
        for name in args.caches:
            step = statistics.median(itl[name])
            read = weights + kv_bytes[name]
            rows.append({"context": context, "cache": name, "itl_ms": step * 1e3, "bytes_per_step": read,
                         "times_floor": step / (read / bandwidth), "vs_fp16": None})
        base = next((r for r in rows if r["context"] == context and r["cache"] == "fp16"), None)
        for r in rows:
            if r["context"] == context and base is not None:
                r["vs_fp16"] = r["itl_ms"] / base["itl_ms"]
    print(f"{loaded.name}, native_dot={args.native_dot}, {facts['cpu']} ({' '.join(facts.get('cpu_flags', []))}), "
          f"{facts['memory_bandwidth_gbs']:.1f} GB/s measured, {args.repeats} interleaved runs")
    print("context  cache       ITL p50 ms  MB a step  x floor  ITL / fp16's")
    for r in rows:
        ratio = "" if r["vs_fp16"] is None else f"{r['vs_fp16']:.2f}"
        print(f"{r['context']:7d}  {r['cache']:10s}  {r['itl_ms']:10.2f}  {r['bytes_per_step'] / 1e6:9.0f}  "
              f"{r['times_floor']:7.2f}  {ratio}")
    if args.out:
        write_json_atomic(args.out, {"model": loaded.name, "native_dot": args.native_dot, "machine": facts,
                                     "rows": rows})


if __name__ == "__main__":
    main()
