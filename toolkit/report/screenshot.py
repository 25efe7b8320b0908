"""Screenshot the HTML report with headless Chromium, with the network cut off (a fresh network namespace via
`unshare -n` where the system allows it), to check the page renders from its own bytes alone.

Chromium is looked up in $SPECQUANT_CHROMIUM, then $SPECQUANT_HOME/chromium (what eval/get_chromium.sh unpacks),
then PATH."""

import os
import shutil
import subprocess
from pathlib import Path

from toolkit.errors import SpecquantError
from toolkit.paths import home

_NAMES = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome", "chrome-headless-shell")


def find_chromium() -> tuple[str, dict] | None:
    """(executable, environment) or None."""
    if explicit := os.environ.get("SPECQUANT_CHROMIUM"):
        return explicit, dict(os.environ)
    root = home() / "chromium"
    binary = root / "usr/lib/chromium/chromium-headless-shell"
    if binary.is_file():
        libs = [root / "usr/lib/x86_64-linux-gnu", root / "usr/lib/chromium",
                root / "usr/lib/x86_64-linux-gnu/pulseaudio"]
        path = ":".join([*map(str, libs), os.environ.get("LD_LIBRARY_PATH", "")])
        return str(binary), {**os.environ, "LD_LIBRARY_PATH": path}
    for name in _NAMES:
        if found := shutil.which(name):
            return found, dict(os.environ)
    return None


def screenshot(page: str | Path, out: str | Path, width: int = 1200, height: int = 1400) -> Path:
    found = find_chromium()
    if found is None:
        raise SpecquantError("no headless Chromium found", "run eval/get_chromium.sh (apt-get download, no install) "
                             "or set SPECQUANT_CHROMIUM=/path/to/chromium")
    binary, env = found
    out = Path(out).expanduser().resolve()
    command = [binary, "--headless", "--no-sandbox", "--disable-gpu", f"--window-size={width},{height}",
               f"--screenshot={out}", Path(page).expanduser().resolve().as_uri()]
    if shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0:
        command = ["unshare", "-n", *command]  # no network interface at all, not even a resolver
    run = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    if run.returncode or not out.is_file():
        raise SpecquantError(f"chromium failed to screenshot {page}: {run.stderr[-500:]}",
                             "check the chromium install (eval/get_chromium.sh)")
    return out
