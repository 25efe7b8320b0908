"""specquant quantize: make a quantized state dict from a float model, write it as a checkpoint directory."""

import shutil
import sys
from pathlib import Path

from omegaconf import OmegaConf
from rich.console import Console

from toolkit import paths
from toolkit.errors import InputError, SpecquantError

console = Console(width=None if sys.stdout.isatty() else 150)


def default_out(model_name: str, q) -> Path:
    group = "pc" if q.group_size == -1 else f"g{q.group_size}"
    stem = Path(model_name).name if Path(model_name).exists() else model_name
    return paths.home() / "checkpoints" / f"{stem}-{q.method}-int{q.bits}-{group}"


def run(cfg) -> Path:
    import torch

    from toolkit.models import load_model
    from toolkit.quant.calibrate import make_quantized_state_dict
    from toolkit.quant.checkpoint import save_quantized
    from toolkit.quant.model_quant import QuantRecipe

    q = cfg.quantize
    try:
        recipe = QuantRecipe(**OmegaConf.to_container(q, resolve=True))
    except ValueError as err:
        raise InputError(f"bad quantize settings: {err}", "see `specquant quantize --help` and recipes/README.md")
    out = Path(cfg.out).expanduser() if cfg.out else default_out(cfg.model.name, q)
    if out.exists() and not cfg.force:
        raise SpecquantError(f"{out} already exists", "pass force=true to replace it, or choose another out=")
    loaded = load_model(cfg.model.name, dtype=torch.float32)
    # a calibrating run saves each finished block here, so a killed run resumes where it stopped
    state_dir = out.with_name(f".{out.name}.state")
    qsd = make_quantized_state_dict(loaded.model, loaded.tokenizer, recipe, state_dir=state_dir)
    save_quantized(out, loaded.model, qsd, tokenizer=loaded.tokenizer, source=loaded.name, force=cfg.force)
    shutil.rmtree(state_dir, ignore_errors=True)
    console.print(f"quantized {len(qsd.weights)} linear layers ({recipe.method}, int{recipe.bits}, group "
                  f"{recipe.group_size}); left in float: {', '.join(n for n, _ in qsd.skipped) or 'none'}")
    console.print(f"wrote {out}\nuse it: specquant generate model={out}")
    return out
