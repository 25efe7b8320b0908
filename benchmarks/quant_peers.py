"""Other tools' weight quantizers side by side with ours: the same calibration windows in, a specquant checkpoint out,
evaluated by `specquant eval` on the same windows, through the same int4 kernels, against the same float model.

The peers (llm-compressor's AWQ/GPTQ/RTN, Intel's AutoRound) pin other transformers versions, so they run in their
own venv (eval/peers/README.md) from scripts that import nothing of ours. They talk to us through two files:

* calibration windows, ``[n, seq_len]`` int64 in a ``.pt`` file, written here by `write_calibration` exactly as
  `specquant quantize` draws them (`toolkit.quant.calibrate.calibration_batches`: BOS first, seeded starts);
* a **dump** the peer writes, one safetensors file: for each quantized Linear ``NAME``, ``NAME.codes`` (uint8
  ``[out, in]``, unsigned codes ``0..2**bits-1``), ``NAME.scale`` (float32 ``[out, in / group_size]``) and
  ``NAME.zero`` (uint8, the code that stands for 0.0), so that ``(codes - zero) * scale`` is the peer's own
  dequantized weight; and every other tensor the peer's model holds, under ``float.<state-dict key>`` (norms and
  embeddings as the peer left them: AWQ folds its scales into the norms). The metadata key ``peer`` holds a JSON
  object: ``tool``, ``method``, ``versions``, ``seconds``, ``peak_rss_gib``, ``bits``, ``group_size``,
  ``symmetric``, ``layers`` (the quantized Linear names) and whatever settings the tool reports.

`checkpoint_from_dump` turns a dump into one of our checkpoint directories (its manifest's ``source`` the float
model, so `specquant eval model=DIR` measures it against that model as it does ours), ``peer.json`` beside it.

    python -m benchmarks.quant_peers calibration --model gemma3-270m --out calib.pt
    python -m benchmarks.quant_peers import --dump peer.safetensors --source gemma3-270m --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from toolkit.errors import InputError
from toolkit.fileio import write_json_atomic
from toolkit.quant.checkpoint import PEER_RECORD, peer_record

_FLOAT = "float."


def write_calibration(model: str, out: str | Path, dataset: str = "pydoc", n_samples: int = 128,
                      seq_len: int = 512, seed: int = 0) -> torch.Tensor:
    """The windows `specquant quantize` calibrates ``model`` on, saved to ``out`` (torch.save, int64)."""
    from toolkit.models import load_tokenizer
    from toolkit.quant.calibrate import calibration_batches

    windows = calibration_batches(load_tokenizer(model), dataset, n_samples, seq_len, seed)
    torch.save(windows, out)
    return windows


def read_dump(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the peer's record, its tensors); a clear error when the file is not a dump."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), "pt") as f:
            record = json.loads((f.metadata() or {})["peer"])
    except (OSError, KeyError, ValueError) as exc:
        raise InputError(f"{path} is not a peer dump ({exc!r}): a safetensors file whose metadata holds 'peer'",
                         "write it with a script in eval/peers/") from exc
    tensors = load_file(str(path))
    missing = [f"{name}.{part}" for name in record.get("layers", []) for part in ("codes", "scale", "zero")
               if f"{name}.{part}" not in tensors]
    if missing:
        raise InputError(f"{path} lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}",
                         "re-run the peer script: the dump was cut short or written by another layout")
    return record, tensors


def checkpoint_from_dump(dump: str | Path, source: str, out: str | Path, force: bool = False) -> Path:
    """Write the dump's model as a specquant checkpoint at ``out`` (``source``: the float model it came from)."""
    from toolkit.models import load_model
    from toolkit.quant.checkpoint import save_quantized
    from toolkit.quant.model_quant import METHODS, QuantizedStateDict, QuantRecipe
    from toolkit.quant.primitives import QuantConfig
    from toolkit.quant.quantized_weight import QuantizedWeight

    record, tensors = read_dump(dump)
    loaded = load_model(source, dtype=torch.float32)
    model = loaded.model.eval()
    floats = {key.removeprefix(_FLOAT): value for key, value in tensors.items() if key.startswith(_FLOAT)}
    try:
        missing, unexpected = model.load_state_dict(floats, strict=False)
    except RuntimeError as exc:  # a tensor of another shape
        raise InputError(f"{dump} does not fit {source}: {str(exc).splitlines()[-1].strip()}",
                         "name the float model the peer quantized as the source") from exc
    layers = record["layers"]
    quantized = {f"{name}.weight" for name in layers}
    tied = {key for key in missing if key.endswith("lm_head.weight")} if model.config.tie_word_embeddings else set()
    absent = [key for key in missing if key not in quantized | tied]
    if unexpected or absent:
        raise InputError(f"{dump} does not fit {source}: unexpected {unexpected[:3]}, missing {absent[:3]}",
                         "name the float model the peer quantized as the source")
    config = QuantConfig(record["bits"], record["group_size"], bool(record["symmetric"]))
    weights, errors = {}, {}
    for name in layers:
        qw = QuantizedWeight(tensors[f"{name}.codes"], tensors[f"{name}.scale"].float(),
                             tensors[f"{name}.zero"].to(torch.int32), config)
        weight = model.get_submodule(name).weight.detach()
        if tuple(weight.shape) != (qw.out_features, qw.in_features):
            raise InputError(f"{dump}: {name} has codes {tuple(qw.codes.shape)}, the model's weight "
                             f"{tuple(weight.shape)}", "name the float model the peer quantized as the source")
        weights[name] = qw
        # against the source's float weight where the peer kept it (RTN, GPTQ); AWQ's folded weights differ
        errors[name] = float((weight - qw.dequantize()).norm() / weight.norm())
    # the recipe names our nearest method (the codes load the same whichever); PEER_RECORD names the peer's, and
    # the engine labels the checkpoint with it
    recipe = QuantRecipe(method=record["method"] if record["method"] in METHODS else "rtn",
                         bits=record["bits"], group_size=record["group_size"], symmetric=bool(record["symmetric"]))
    path = save_quantized(out, model, QuantizedStateDict(weights, recipe, errors=errors), loaded.tokenizer,
                          source=source, force=force)
    write_json_atomic(path / PEER_RECORD, record)  # after the manifest, which does not list it: a checkpoint
    return path                                    # killed before it loads as ours, labelled with our method


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quant_peers", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    calib = sub.add_parser("calibration", help="write the calibration windows specquant quantize uses")
    calib.add_argument("--model", required=True)
    calib.add_argument("--out", required=True)
    calib.add_argument("--dataset", default="pydoc")
    calib.add_argument("--n-samples", type=int, default=128)
    calib.add_argument("--seq-len", type=int, default=512)
    imp = sub.add_parser("import", help="a peer's dump -> a specquant checkpoint directory")
    imp.add_argument("--dump", required=True)
    imp.add_argument("--source", required=True, help="the float model the peer quantized (registry name or dir)")
    imp.add_argument("--out", required=True)
    imp.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "calibration":
        windows = write_calibration(args.model, args.out, args.dataset, args.n_samples, args.seq_len)
        print(f"wrote {args.out}: {tuple(windows.shape)} windows of {args.dataset}")
    else:
        path = checkpoint_from_dump(args.dump, args.source, args.out, args.force)
        record = peer_record(path)
        print(f"wrote {path}: {len(record['layers'])} layers from {record['tool']} {record['method']} "
              f"({record['seconds']:.1f} s, peak RSS {record['peak_rss_gib']:.2f} GiB in the peer's run)")


if __name__ == "__main__":
    main()
