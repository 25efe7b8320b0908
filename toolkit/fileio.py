"""File writing that never leaves a half-written file behind, and the checksums that detect one."""

import hashlib
import json
import mmap
import os
from pathlib import Path

import xxhash

_BLOCK = 16 << 20


def write_json_atomic(path: str | os.PathLike, data: dict, **dump_kwargs) -> Path:
    """Write JSON through a temp file in the same folder, fsync it, then os.replace: a reader (or a crash) sees
    the old file or the new one, never part of one."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, default=str, **dump_kwargs)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def save_torch_atomic(obj, path: str | os.PathLike) -> Path:
    """``torch.save`` through a temp file in the same folder, then os.replace (a crash leaves the old file)."""
    import torch  # not at module level: the rest of this module serves callers that never load torch

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def xxh3_file(path: str | os.PathLike) -> str:
    """xxh3-128 of a file: ~10x faster than sha256, so loads can check every file every time."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_128(b"").hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return xxhash.xxh3_128(view).hexdigest()


def checksum_files(root: Path, exclude: set[str] = frozenset()) -> dict[str, dict]:
    """{relative posix path: {size, xxh3_128}} for every file under root except the top-level names in exclude:
    what a manifest records so a later load can tell a complete directory from a damaged one."""
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel not in exclude:
            out[rel] = {"size": path.stat().st_size, "xxh3_128": xxh3_file(path)}
    return out


def file_problem(path: Path, record: dict, hashed: bool = True) -> str | None:
    """What is wrong with `path` against its manifest record ({size, xxh3_128}), or None if nothing is."""
    if not path.is_file():
        return "is missing"
    if (size := path.stat().st_size) != record["size"]:
        return f"has {size} bytes, the manifest says {record['size']} (truncated?)"
    if hashed and xxh3_file(path) != record["xxh3_128"]:
        return "does not match its recorded xxh3_128 checksum (corrupt)"
    return None
