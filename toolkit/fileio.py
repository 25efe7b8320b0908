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
