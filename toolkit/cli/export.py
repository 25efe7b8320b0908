"""specquant export: a specquant quantized checkpoint -> a GPTQ v1 or AWQ GEMM directory other tools load."""

import sys
from pathlib import Path

from rich.console import Console

from toolkit.errors import InputError

console = Console(width=None if sys.stdout.isatty() else 150)


def run(cfg) -> Path:
    from toolkit.quant.checkpoint import is_quantized_checkpoint
    from toolkit.quant.formats import FORMATS, export_checkpoint

    source = Path(cfg.model.name).expanduser()
    if not is_quantized_checkpoint(source):
        raise InputError(f"model={cfg.model.name} is not a specquant quantized checkpoint",
                         "make one with `specquant quantize ... out=DIR`, then export model=DIR")
    if cfg.format not in FORMATS:
        raise InputError(f"unknown format={cfg.format}", f"use format={' or format='.join(FORMATS)}")
    out = Path(cfg.out).expanduser() if cfg.out else source.with_name(f"{source.name}-{cfg.format}")
    written = export_checkpoint(source, cfg.format, out, force=cfg.force)
    size = sum(f.stat().st_size for f in written.rglob("*") if f.is_file())
    console.print(f"wrote {written} ({cfg.format}, {size / 2**20:.1f} MiB)")
    console.print(f"load it: specquant generate model={written}   (or transformers with gptqmodel installed)")
    return written
