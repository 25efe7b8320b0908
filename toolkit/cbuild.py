"""Build the project's small C kernels with the system compiler on first use, cached under $SPECQUANT_HOME/kernels.

Plain C called through ctypes, not torch extensions: no torch or Python headers (a torch extension build takes
minutes on two cores; these take about a second). The sources and their shared headers live in one folder,
toolkit/kernels/ (`source` names one). A library's name hashes its source, the files it #includes, the compiler, the
flags and the CPU's model, so a changed kernel or header, or another machine, builds its own; `-march=native` is safe
because the cache is read on the machine that built it. Each wrapper (toolkit/quant/*_native.py, toolkit/quant/vnni.py,
toolkit/kv/native.py, toolkit/engine/native_decoder.py) falls back to torch ops where nothing builds; `Kernel` is
what the GEMM wrappers share: the build, the functions' signatures, the self-test and the loaded library.
"""

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Callable

from toolkit import cpu
from toolkit.paths import home

KERNELS = Path(__file__).parent / "kernels"
"""The C sources and their headers (shipped with the package: pyproject.toml's package data)."""

DISABLE_ENV = "SPECQUANT_NO_KERNELS"
"""Set (to anything) to use torch ops everywhere instead of the C kernels."""


def disabled() -> bool:
    return bool(os.environ.get(DISABLE_ENV))


def compiler() -> str | None:
    """$CC, else cc / gcc / clang on PATH, else None."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def source(name: str) -> Path:
    """The kernel source or header `name` in toolkit/kernels/, e.g. ``source("int4_gemm.c")``."""
    return KERNELS / name


_QUOTED_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def quoted_includes(path: Path) -> list[Path]:
    """The files `path` #includes in quotes (found beside the file that names them, as the compiler finds them first)
    and the ones those include in turn: each once, in the order first named."""
    found, todo = {}, [path]
    while todo:
        current = todo.pop(0)
        for name in _QUOTED_INCLUDE.findall(current.read_bytes()):
            included = current.parent / name.decode()
            if included != path and included not in found and included.is_file():
                found[included] = None
                todo.append(included)
    return list(found)


def build(source: Path, stem: str, compiler: str, flags: list[str]) -> Path:
    """The shared library of `source` built with `flags` (built once, then found in the cache). The files `source`
    #includes in quotes (`quoted_includes`: tiles.h, and the GEMMs that decoder_layers.c includes) go into the cache
    key with it, so a changed header or kernel rebuilds everything that includes it. Raises RuntimeError with the
    compiler's message if the build fails."""
    text = source.read_bytes() + b"".join(p.read_bytes() for p in quoted_includes(source))
    key = hashlib.sha256(text + " ".join([compiler, *flags, cpu.model(), *sorted(cpu.hardware_flags())]).encode()).hexdigest()[:16]
    target = home() / "kernels" / f"{stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, renamed into place: never half a file
        built = Path(tmp) / target.name
        run = subprocess.run([compiler, *flags, "-o", str(built), str(source)], capture_output=True, text=True,
                             timeout=120)
        if run.returncode:
            raise RuntimeError(f"{compiler} failed: {run.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


def build_openmp(source: Path, stem: str, compiler: str, flags: list[str]) -> Path:
    """`build`, retried without -fopenmp where the compiler has no OpenMP (the kernel then runs one thread)."""
    try:
        return build(source, stem, compiler, flags)
    except RuntimeError:
        if "-fopenmp" not in flags:
            raise
        return build(source, stem, compiler, [f for f in flags if f != "-fopenmp"])


def load_library(source: Path, stem: str, flags: list[str], what: str, fallback: str, log: logging.Logger):
    """ctypes.CDLL of `source` built with `flags` (retried without OpenMP), or None with a warning naming `what`
    did not build and the `fallback` used instead: no compiler, a failed build, or kernels switched off."""
    if disabled():
        return None
    cc = compiler()
    if not cc:
        log.warning("no C compiler found: %s", fallback)
        return None
    try:
        return ctypes.CDLL(str(build_openmp(source, stem, cc, list(flags))))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("the %s did not build (%s): %s", what, e, fallback)
        return None


def self_test_verdict(rc: int, correct: bool, needs: str) -> str | None:
    """What a kernel module's self-test returns: None when the kernel gave the known product (`correct`, status 0),
    else why not -- status 2 means the CPU lacks `needs`, the instructions the kernel was written for."""
    if rc == 0 and correct:
        return None
    return f"rc {rc}; it needs {needs}" if rc == 2 else f"rc {rc}"


def load_kernel(source: Path, stem: str, flags: list[str], what: str, fallback: str, log: logging.Logger,
                signatures: dict[str, list], self_test: Callable | None):
    """`load_library`, then each named function's ctypes argument types (all return an int status), then
    `self_test(lib)` where given: a known product, returning None where the kernel gives it and else why not (a
    status code: 2 means the CPU lacks the instructions the kernel was written for). None, with an info line naming
    `fallback`, where it fails."""
    lib = load_library(source, stem, flags, what, fallback, log)
    if lib is None:
        return None
    for name, argtypes in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    problem = self_test(lib) if self_test else None
    if problem:
        log.info("the %s is not usable on this CPU (%s): %s", what, problem, fallback)
        return None
    return lib


class Kernel:
    """A kernel of toolkit/kernels/ as its wrapper module uses it: `load(flags)` builds and loads it (`load_kernel`:
    the functions' argument types, then the self-test), `library()` is the library the module runs on (loaded once,
    with the module's flags; `library.cache_clear()` forgets it) or None, and `available()` says whether there is
    one. A module exports them: ``load, kernel, available = KERNEL.load, KERNEL.library, KERNEL.available``."""

    def __init__(self, name: str, stem: str, flags: list[str], what: str, fallback: str, log: logging.Logger,
                 signatures: dict[str, list], self_test: Callable | None = None):
        self.source, self.stem, self.flags = source(name), stem, tuple(flags)
        self.what, self.fallback, self.log = what, fallback, log
        self.signatures, self.self_test = signatures, self_test
        self.library = lru_cache(maxsize=1)(self.load)

    def load(self, flags: tuple[str, ...] | None = None):
        """Build (once per source, flags and CPU) and load the library with `flags` (default: the module's); None,
        with a log line saying why and what runs instead, where it does not build or the CPU cannot run it."""
        return load_kernel(self.source, self.stem, list(self.flags if flags is None else flags), self.what,
                           self.fallback, self.log, self.signatures, self.self_test)

    def available(self) -> bool:
        return self.library() is not None
