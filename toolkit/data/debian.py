"""Getting a Debian package's files without installing it: apt-get download + dpkg-deb -x, so no root is needed."""

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.data.documents import Document
from toolkit.errors import DataError


@dataclass(frozen=True)
class DebianPackage:
    package: str
    marker: str  # a file the package installs, relative to /: if present, the package is installed already
    parse: Callable[[Path], list[Document]] = field(repr=False)  # reads documents under an extraction root


def package_root(name: str, package: DebianPackage, workdir: Path, step: Callable[[str], None]) -> tuple[Path, str]:
    """Where the files of `package` (for dataset `name`) can be read, and a label for where they came from:
    / when the package is installed already, else its .deb downloaded and unpacked under `workdir`."""
    if Path("/", package.marker).is_file():
        step(f"using installed {package.package}")
        return Path("/"), f"{package.package} (installed)"
    step(f"downloading {package.package} (apt-get)")
    deb = _apt_download(name, package.package, workdir)
    step(f"unpacking {deb.name}")
    return _extract(deb, workdir / "root"), deb.name


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True)


def _apt_download(name: str, package: str, workdir: Path) -> Path:
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise DataError(f"`specquant data fetch {name}` downloads Debian package {package}, "
                        "but apt-get/dpkg-deb are not available here",
                        fix=f"run it on Debian or Ubuntu with access to the Debian package registry, "
                            f"or install {package} there")
    argv = ["apt-get", "download", "-q", package]
    if os.geteuid() == 0:  # as root apt drops to user _apt, which cannot write into our private temp dir
        argv[2:2] = ["-o", "APT::Sandbox::User=root"]
    result = _run(argv, workdir)
    debs = sorted(workdir.glob(f"{package}_*.deb"))
    if result.returncode != 0 or not debs:
        message = (result.stderr or result.stdout).strip().splitlines()
        reason = message[-1] if message else f"apt-get exited with {result.returncode}"
        raise DataError(f"could not download Debian package {package}: {reason}",
                        fix=f"`specquant data fetch {name}` needs the Debian package registry: check the network, "
                            "run `apt-get update` (as root) and try again")
    return debs[-1]


def _extract(deb: Path, root: Path) -> Path:
    result = _run(["dpkg-deb", "-x", str(deb), str(root)], deb.parent)
    if result.returncode != 0:
        raise DataError(f"could not unpack {deb.name}: {result.stderr.strip()}", fix="run the fetch again")
    return root
