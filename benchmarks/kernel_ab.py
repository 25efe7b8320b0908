"""Two builds of the native decoder stack in one process, decode step by decode step on the same caches: the
working tree's kernels (B) against another revision's (A), alternating A, B / B, A every step. On a shared machine
whose speed drifts by a fifth from one minute to the next, this is the comparison that holds; separate runs do
not (docs/notes/2026-12-07-kivi-integer-reads.md).

    python -m benchmarks.kernel_ab --rev HEAD~1 --model ~/.cache/specquant/checkpoints/smollm2-135m-rtn-w4g64 \\
        --native-dot int8 --context 8000 --caches fp16 int8 int4

Prints, per cache, each build's median step and B / A, and each cache's step over the fp16 cache's under B.
"""

import copy
import ctypes
import pathlib
import statistics
import subprocess
import tempfile
import time

import torch

import toolkit.engine.native_decoder as native_decoder
from benchmarks._cli import parser
from benchmarks.kv_store import CACHES
from toolkit import cbuild
from toolkit.engine.setup import load_engine_model
from toolkit.engine.spec import EngineSpec
from toolkit.kv import make_kv_cache

KERNELS = pathlib.Path(native_decoder.SOURCE).parent


def _kernels_at(rev: str, into: pathlib.Path) -> pathlib.Path:
    """toolkit/kernels as revision `rev` holds it, written into `into`."""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:toolkit/kernels"], check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        text = subprocess.run(["git", "show", f"{rev}:toolkit/kernels/{name}"], check=True, capture_output=True).stdout
        (into / name).write_bytes(text)
    return into


def _build(kernels: pathlib.Path):
    """The stack built from `kernels`, with the entry points a decode step calls typed (an older build may lack
    newer ones; the structs only grew at their ends)."""
    lib = cbuild.load_library(kernels / "decoder_layers.c", "decoder-layers", list(native_decoder.FLAGS),
                              "native decoder", "no comparison", native_decoder.log)
    if lib is None:
        raise SystemExit(f"the native decoder did not build from {kernels}")
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for name in ("sq_decoder_layers", "sq_decoder_layers_kvq"):
        getattr(lib, name).argtypes = [p, i64, p, p, i64, p, p, p, p, i64]
        getattr(lib, name).restype = ctypes.c_int
    return lib


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rev", default="HEAD", help="git revision whose kernels are build A (B: the working tree's)")
    p.add_argument("--native-dot", default="fp32", help="engine.native_dot (fp32, bf16, int8)")
    p.add_argument("--context", type=int, default=8000, help="prompt tokens")
    p.add_argument("--caches", nargs="+", default=["fp16", "int8", "int4"], choices=list(CACHES))
    p.add_argument("--steps", type=int, default=60, help="decode steps per build and cache")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        libs = [_build(_kernels_at(args.rev, pathlib.Path(tmp))), _build(KERNELS)]
    model = load_engine_model(args.model, EngineSpec(native_dot=args.native_dot)).model
    ids = torch.tensor([[(i * 7919) % 40000 + 100 for i in range(args.context)]])  # decode cost does not read it
    native_decoder.library = lambda: libs[1]
    # each build its own copy of each cache, so both meet the steps where tokens leave a quantized cache's window
    # (slower, every 8th) at the same positions
    caches, last, times = {}, {}, {(c, b): [] for c in args.caches for b in (0, 1)}
    with torch.inference_mode():
        for name in args.caches:
            cache = make_kv_cache(model, args.context + args.steps + 8, CACHES[name])
            token = model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1].argmax()
            for b in (0, 1):
                caches[(name, b)], last[(name, b)] = copy.deepcopy(cache), token
            del cache
        for step in range(args.steps + 4):
            for name in args.caches:
                for b in (0, 1) if step % 2 == 0 else (1, 0):
                    native_decoder.library = (lambda lib: lambda: lib)(libs[b])
                    start = time.perf_counter()
                    last[(name, b)] = model(input_ids=last[(name, b)].view(1, 1), cache=caches[(name, b)],
                                            use_cache=True).logits[0, -1].argmax()
                    if step >= 4:  # past the first steps' warm-up
                        times[(name, b)].append(time.perf_counter() - start)
    med = {key: statistics.median(v) * 1e3 for key, v in times.items()}
    print(f"{args.model}, native_dot={args.native_dot}, {args.context} tokens, A = {args.rev}, B = working tree, "
          f"{args.steps} steps each, alternating")
    print("cache       A ms     B ms    B / A   B / fp16's")
    for name in args.caches:
        vs = f"{med[(name, 1)] / med[('fp16', 1)]:.3f}" if "fp16" in args.caches else ""
        print(f"{name:10s} {med[(name, 0)]:6.2f}  {med[(name, 1)]:6.2f}  {med[(name, 1)] / med[(name, 0)]:6.3f}   {vs}")


if __name__ == "__main__":
    main()
