"""specquant quantize: make a quantized state dict from a float model, write it as a checkpoint directory."""

import shutil
import sys
from pathlib import Path

from omegaconf import OmegaConf
from rich.console import Console

from toolkit import paths
from toolkit.errors import InputError, SpecquantError
from toolkit.models import load_model
from toolkit.quant.calibrate import make_quantized_state_dict
from toolkit.quant.checkpoint import TENSORS, save_quantized
from toolkit.quant.model_quant import QuantRecipe
from toolkit.quant.offload import load_offloaded

console = Console(width=None if sys.stdout.isatty() else 150)


def default_out(model_name: str, q) -> Path:
    group = "pc" if q.group_size == -1 else f"g{q.group_size}"
    stem = Path(model_name).name if Path(model_name).exists() else model_name
    return paths.home() / "checkpoints" / f"{stem}-{q.method}-int{q.bits}-{group}"


def output_dir(cfg) -> Path | None:
    """``output=`` (the issue's name) or ``out=`` (the other commands'); both given must agree."""
    output, out = cfg.get("output"), cfg.get("out")
    if output and out and Path(output).expanduser() != Path(out).expanduser():
        raise InputError(f"output={output} and out={out} name different directories", "give only one of them")
    value = output or out
    return Path(value).expanduser() if value else None


def quantized_bytes(qsd) -> tuple[int, int]:
    """``(fp16 bytes, stored bytes)`` of the quantized layers: 2 bytes a weight, vs the checkpoint's codes
    (bits/8 a weight, packed as the checkpoint packs them) + fp32 scales + uint8 zeros (+ int32 g_idx)."""
    before = after = 0
    for qw in qsd.weights.values():
        n = qw.codes.numel()
        before += 2 * n
        per_byte = 2 if qw.config.bits <= 4 and qw.in_features % 2 == 0 else 1
        after += n // per_byte + qw.scale.numel() * 4 + qw.zero.numel() + (0 if qw.g_idx is None else 4 * qw.in_features)
    return before, after


def error_summary(errors: dict[str, float]) -> list[tuple[str, int, float, float, str]]:
    """Per layer kind (``q_proj``, ...): ``(kind, count, mean, max, worst layer)`` of the relative errors."""
    kinds: dict[str, list[tuple[float, str]]] = {}
    for name, err in errors.items():
        kinds.setdefault(name.rsplit(".", 1)[-1], []).append((err, name))
    rows = []
    for kind, values in kinds.items():
        worst = max(values)
        rows.append((kind, len(values), sum(v for v, _ in values) / len(values), worst[0], worst[1]))
    return rows


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run(cfg) -> Path:
    import time

    import torch
    from rich.table import Table

    q = cfg.quantize
    try:
        recipe = QuantRecipe(**OmegaConf.to_container(q, resolve=True))
    except (TypeError, ValueError) as err:
        raise InputError(f"bad quantize settings: {err}", "see `specquant quantize --help` and recipes/README.md")
    out = output_dir(cfg) or default_out(cfg.model.name, q)
    if out.exists() and not cfg.force:
        raise SpecquantError(f"{out} already exists", "pass force=true to replace it, or choose another output=")
    if cfg.get("offload"):  # larger than RAM: accelerate keeps what does not fit in max_memory on disk

        loaded = load_offloaded(cfg.model.name, cfg.offload, cfg.get("max_memory"))
    else:
        loaded = load_model(cfg.model.name, dtype=torch.float32)
    # a calibrating run saves each finished block here, so a killed run resumes where it stopped
    state_dir = out.with_name(f".{out.name}.state")
    start = time.perf_counter()
    qsd = make_quantized_state_dict(loaded.model, loaded.tokenizer, recipe, state_dir=state_dir)
    seconds = time.perf_counter() - start
    save_quantized(out, loaded.model, qsd, tokenizer=loaded.tokenizer, source=loaded.name, force=cfg.force)
    shutil.rmtree(state_dir, ignore_errors=True)

    before, after = quantized_bytes(qsd)
    table = Table(title="relative weight error ||W - deq(Q)|| / ||W|| per layer kind")
    for column in ("layer", "count", "mean", "max", "worst layer"):
        table.add_column(column)
    for kind, count, mean, worst, name in error_summary(qsd.errors):
        table.add_row(kind, str(count), f"{mean:.4f}", f"{worst:.4f}", name)
    console.print(table)
    calib = (f", {recipe.n_samples} x {recipe.seq_len} calibration tokens, forwards in {qsd.recipe.calib_dtype}"
             if recipe.method != "rtn" else "")
    console.print(f"quantized {len(qsd.weights)} linear layers ({recipe.method}, int{recipe.bits}, group "
                  f"{recipe.group_size}{calib}) in {seconds:.1f} s; peak RSS {peak_rss_bytes() / 2**30:.2f} GiB")
    console.print(f"quantized layers: {before / 1e6:.1f} MB at fp16 -> {after / 1e6:.1f} MB "
                  f"({before / max(after, 1):.2f}x smaller); checkpoint tensors {(out / TENSORS).stat().st_size / 1e6:.1f} MB")
    if qsd.tuning:
        kl_before = qsd.tuning["kl_before"]
        console.print(f"scale tuning: {qsd.tuning['steps']} steps in {qsd.tuning['seconds']:.1f} s; KL to the float "
                      f"model on the first calibration windows "
                      f"{'(resumed)' if kl_before is None else f'{kl_before:.4f}'} "
                      f"-> {qsd.tuning['kl_after']:.4f} (the per-layer errors above are the method's, before it)")
    if qsd.timings:
        console.print("time by phase: " + ", ".join(f"{k} {v:.1f} s" for k, v in qsd.timings.items()))
    console.print(f"left in float: {', '.join(n for n, _ in qsd.skipped) or 'none'}")
    console.print(f"wrote {out}\nuse it: specquant generate model={out}")
    return out
