"""specquant export: a specquant quantized checkpoint -> a GPTQ v1 or AWQ GEMM directory other tools load, or a
checkpoint / float model -> one GGUF file llama.cpp runs."""

import sys
from pathlib import Path

from rich.console import Console

from toolkit.errors import InputError
from toolkit.quant.checkpoint import is_quantized_checkpoint
from toolkit.quant.formats import FORMATS, export_checkpoint
from toolkit.quant.formats.gguf_export import export_gguf

console = Console(width=None if sys.stdout.isatty() else 150)


def run(cfg) -> Path:

    if cfg.format == "gguf":
        return _gguf(cfg)
    source = Path(cfg.model.name).expanduser()
    if not is_quantized_checkpoint(source):
        raise InputError(f"model={cfg.model.name} is not a specquant quantized checkpoint",
                         "make one with `specquant quantize ... out=DIR`, then export model=DIR")
    if cfg.format not in FORMATS:
        raise InputError(f"unknown format={cfg.format}", f"use format={' or format='.join(FORMATS)} or format=gguf")
    out = Path(cfg.out).expanduser() if cfg.out else source.with_name(f"{source.name}-{cfg.format}")
    written = export_checkpoint(source, cfg.format, out, force=cfg.force)
    size = sum(f.stat().st_size for f in written.rglob("*") if f.is_file())
    console.print(f"wrote {written} ({cfg.format}, {size / 2**20:.1f} MiB)")
    console.print(f"load it: specquant generate model={written}   (or transformers with gptqmodel installed)")
    return written


def _gguf(cfg) -> Path:

    source = Path(str(cfg.model.name)).expanduser()
    gguf_type = str(cfg.get("type") or "auto").lower()
    if cfg.out:
        out = Path(cfg.out).expanduser()
    elif source.is_dir():
        out = source.with_name(f"{source.name}-{gguf_type}.gguf")
    else:
        out = Path(f"{cfg.model.name}-{gguf_type}.gguf")
    result = export_gguf(cfg.model.name, out, gguf_type, force=cfg.force)
    diffs = ", ".join(f"{t} {d:.2g}" for t, d in result.max_abs_diff().items())
    console.print(f"wrote {result.path} ({result.main_type}, {result.path.stat().st_size / 2**20:.1f} MiB): "
                  f"{result.weights}; max |GGUF - specquant| per type: {diffs}", highlight=False)
    if result.requantized:
        console.print(f"requantized (the grid has no llama.cpp block type): {len(result.requantized)} tensors, e.g. "
                      f"{', '.join(result.requantized[:3])}", style="yellow", highlight=False)
    return result.path
