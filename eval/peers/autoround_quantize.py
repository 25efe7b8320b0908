"""Intel's AutoRound (SignRound: each weight's rounding offset and each group's min/max range learned by signed
gradient descent on a block's output), as its users run it, on our calibration windows; writes a dump
(benchmarks/quant_peers.py) for `python -m benchmarks.quant_peers import`. Runs in the peers' venv
(eval/peers/README.md).

    python eval/peers/autoround_quantize.py --model DIR --calibration calib.pt --out dump.safetensors [--iters 200]

AutoRound's defaults otherwise (its learning rate 1/iters, batch 8, its own precision choices on the device); 4 bits,
asymmetric, group 128 unless told."""

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from peer_dump import peak_rss_gib, versions, write_dump


def codes_of(module, bits: int):
    """(codes, scale, zero) of a Linear AutoRound finished, and how far ``(codes - zero) * scale`` is from the
    weight it left. AutoRound leaves the dequantized weight in ``weight`` (computed in its autocast precision, bf16
    on a CPU) and ``scale`` (its scale_dtype, fp16) / ``zp`` beside it; an export stores codes, scale and zp, so
    ``(codes - zp) * scale`` is what its checkpoints compute. The codes are recovered as ``weight / scale``, which
    must sit within a small fraction of a step of an integer (bf16's rounding of the weight moves it by at most
    ~15 * 2**-9 steps), or the recovery is ambiguous and the run stops."""
    weight, scale, zero = module.weight.detach().float(), module.scale.float(), module.zp.to(torch.int64)
    groups = torch.arange(weight.shape[1]) // (weight.shape[1] // scale.shape[1])
    steps = weight / scale[:, groups]
    off_grid = float((steps - torch.round(steps)).abs().max())
    if off_grid > 0.1:
        raise SystemExit(f"AutoRound's weight is {off_grid:.3f} of a step off its own grid: codes are ambiguous")
    codes = (torch.round(steps).to(torch.int64) + zero[:, groups]).clamp(0, 2**bits - 1)
    dequantized = (codes - zero[:, groups]).float() * scale[:, groups]
    relative = float((dequantized - weight).abs().max() / weight.abs().max())
    return (codes, scale, zero), off_grid, relative


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="float model directory (save_pretrained)")
    parser.add_argument("--calibration", required=True, help="[n, seq_len] int64 windows (torch.save)")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from auto_round import AutoRound

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    windows = torch.load(args.calibration)
    batches = list(windows.split(args.batch_size))
    start = time.perf_counter()
    rounder = AutoRound(model, tokenizer, bits=args.bits, group_size=args.group_size, sym=False, dataset=batches,
                        nsamples=windows.shape[0], seqlen=windows.shape[1], batch_size=args.batch_size,
                        iters=args.iters, device_map="cpu")
    rounder.quantize()
    seconds = time.perf_counter() - start
    layers, off_grid, relative = {}, 0.0, 0.0
    for name, module in rounder.model.named_modules():
        if isinstance(module, torch.nn.Linear) and getattr(module, "scale", None) is not None:
            layers[name], off, rel = codes_of(module, args.bits)
            off_grid, relative = max(off_grid, off), max(relative, rel)
    record = {"tool": "auto-round", "method": "autoround", "iters": args.iters, "batch_size": args.batch_size,
              "versions": versions("auto-round", "transformers", "torch"), "seconds": seconds,
              "peak_rss_gib": peak_rss_gib(), "bits": args.bits, "group_size": args.group_size, "symmetric": False,
              "calibration": list(windows.shape), "max_steps_off_grid": off_grid,
              "max_relative_difference_to_weight_left": relative}
    write_dump(args.out, rounder.model, layers, record)
    print(json.dumps(record), f"{len(layers)} layers -> {args.out}")


if __name__ == "__main__":
    main()
