"""llm-compressor (vLLM's) weight quantization, as its users run it, on our calibration windows; writes a dump
(benchmarks/quant_peers.py) for `python -m benchmarks.quant_peers import`. Runs in the peers' venv
(eval/peers/README.md).

    python eval/peers/llmcompressor_quantize.py --model DIR --calibration calib.pt --method awq --out dump.safetensors

--method awq: `AWQModifier()` (its default mappings for the architecture) then `QuantizationModifier`;
gptq: `GPTQModifier`; rtn: `QuantizationModifier` alone. All with scheme W4A16_ASYM (4 bits, asymmetric, group 128),
targets Linear, lm_head ignored: the examples' recipe. `--group-size N` keeps the scheme's weights but groups of N
(its presets are all g128; SmolLM2's width 576 needs g64), as a `config_groups` entry, the documented way to set one."""

import argparse
import json
import time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from peer_dump import peak_rss_gib, versions, write_dump


def recipe(method: str, scheme: str, group_size: int | None):
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    if group_size is None:
        quant = dict(ignore=["lm_head"], scheme=scheme, targets=["Linear"])
    else:
        from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme

        weights = preset_name_to_scheme(scheme, ["Linear"]).weights.model_copy(update={"group_size": group_size})
        group = QuantizationScheme(targets=["Linear"], weights=weights)
        quant = dict(ignore=["lm_head"], config_groups={"group_0": group})
    return {"awq": lambda: [AWQModifier(), QuantizationModifier(**quant)],
            "gptq": lambda: [GPTQModifier(**quant)],
            "rtn": lambda: [QuantizationModifier(**quant)]}[method]()


def codes_of(module):
    """(unsigned codes, scale, unsigned zero) of a quantized Linear, checked against compressed-tensors' own
    fake quantization of it, bit for bit."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize, quantize

    args = module.quantization_scheme.weights
    weight = module.weight.detach().float()
    scale, zero = module.weight_scale.detach(), module.weight_zero_point.detach()
    signed = quantize(weight, scale, zero, args).to(torch.int32)
    offset = 2 ** (args.num_bits - 1)  # compressed-tensors' asymmetric int4 codes are signed, -8..7
    codes, zero_u = signed + offset, zero.to(torch.int32) + offset
    groups = torch.arange(weight.shape[1]) // args.group_size
    dequantized = (codes - zero_u[:, groups]).float() * scale.float()[:, groups]
    if not torch.equal(dequantized, fake_quantize(weight, scale, zero, args).float()):
        raise SystemExit("codes do not reproduce compressed-tensors' fake quantization")
    return (codes, scale.float(), zero_u), args


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="float model directory (save_pretrained)")
    parser.add_argument("--calibration", required=True, help="[n, seq_len] int64 windows (torch.save)")
    parser.add_argument("--method", choices=("awq", "gptq", "rtn"), required=True)
    parser.add_argument("--scheme", default="W4A16_ASYM")
    parser.add_argument("--group-size", type=int, help="the scheme's weights in groups of this many (default: its own)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from llmcompressor import oneshot
    from llmcompressor.pipelines.cache import IntermediatesCache

    if not torch.accelerator.is_available():  # llm-compressor 0.14's AWQ pins memory unconditionally: on a CPU
        IntermediatesCache.pin_memory = lambda self, *a, **k: None  # that raises ("Cannot access accelerator")

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    windows = torch.load(args.calibration)
    data = Dataset.from_dict({"input_ids": windows.tolist(), "attention_mask": torch.ones_like(windows).tolist()})
    start = time.perf_counter()
    oneshot(model=model, dataset=data, recipe=recipe(args.method, args.scheme, args.group_size),
            max_seq_length=windows.shape[1], num_calibration_samples=windows.shape[0])
    seconds = time.perf_counter() - start
    layers, qargs = {}, None
    for name, module in model.named_modules():
        if hasattr(module, "weight_scale"):
            layers[name], qargs = codes_of(module)
    record = {"tool": "llm-compressor", "method": args.method, "scheme": args.scheme,
              "versions": versions("llmcompressor", "compressed-tensors", "transformers", "torch"),
              "seconds": seconds, "peak_rss_gib": peak_rss_gib(), "bits": qargs.num_bits,
              "group_size": qargs.group_size, "symmetric": bool(qargs.symmetric), "observer": str(qargs.observer),
              "calibration": list(windows.shape)}
    write_dump(args.out, model, layers, record)
    print(json.dumps(record), f"{len(layers)} layers -> {args.out}")


if __name__ == "__main__":
    main()
