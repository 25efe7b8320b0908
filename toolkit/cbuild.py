"""Build the project's small C kernels with the system compiler on first use, cached under $SPECQUANT_HOME/kernels.

Plain C called through ctypes, not torch extensions: no torch or Python headers (a torch extension build takes
minutes on two cores; these take about a second). A library's name hashes its source, the compiler, the flags and
the CPU's model, so a changed kernel or another machine builds its own; `-march=native` is safe because the cache is
read on the machine that built it. Used by the KV dequantization kernel (toolkit/kv/native.py) and the int4 GEMM
(toolkit/quant/int4_native.py); each falls back to torch ops where nothing builds.
"""

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from toolkit import cpu
from toolkit.paths import home

DISABLE_ENV = "SPECQUANT_NO_KERNELS"
"""Set (to anything) to use torch ops everywhere instead of the C kernels."""


def disabled() -> bool:
    return bool(os.environ.get(DISABLE_ENV))


def compiler() -> str | None:
    """$CC, else cc / gcc / clang on PATH, else None."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def build(source: Path, stem: str, compiler: str, flags: list[str], includes: tuple[Path, ...] = ()) -> Path:
    """The shared library of `source` built with `flags` (built once, then found in the cache). `includes`: the files
    `source` #includes from other folders (their folders go on the include path and their bytes into the cache
    key, so a changed kernel rebuilds what includes it). Raises RuntimeError with the compiler's message if the
    build fails."""
    flags = [*flags, *(f"-I{d}" for d in dict.fromkeys(str(p.parent) for p in includes))]
    text = source.read_bytes() + b"".join(p.read_bytes() for p in includes)
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


def build_openmp(source: Path, stem: str, compiler: str, flags: list[str], includes: tuple[Path, ...] = ()) -> Path:
    """`build`, retried without -fopenmp where the compiler has no OpenMP (the kernel then runs one thread)."""
    try:
        return build(source, stem, compiler, flags, includes)
    except RuntimeError:
        if "-fopenmp" not in flags:
            raise
        return build(source, stem, compiler, [f for f in flags if f != "-fopenmp"], includes)


def load_library(source: Path, stem: str, flags: list[str], what: str, fallback: str, log: logging.Logger,
                 includes: tuple[Path, ...] = ()):
    """ctypes.CDLL of `source` built with `flags` (retried without OpenMP), or None with a warning naming `what`
    did not build and the `fallback` used instead: no compiler, a failed build, or kernels switched off."""
    if disabled():
        return None
    cc = compiler()
    if not cc:
        log.warning("no C compiler found: %s", fallback)
        return None
    try:
        return ctypes.CDLL(str(build_openmp(source, stem, cc, list(flags), includes)))
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
                signatures: dict[str, list], self_test, includes: tuple[Path, ...] = ()):
    """`load_library`, then each named function's ctypes argument types (all return an int status), then
    `self_test(lib)`: a known product, returning None where the kernel gives it and else why not (a status code:
    2 means the CPU lacks the instructions the kernel was written for). None, with an info line naming `fallback`,
    where it fails."""
    lib = load_library(source, stem, flags, what, fallback, log, includes)
    if lib is None:
        return None
    for name, argtypes in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    problem = self_test(lib)
    if problem:
        log.info("the %s is not usable on this CPU (%s): %s", what, problem, fallback)
        return None
    return lib
