"""Directories that appear whole or not at all: built in a temp sibling, then renamed into place.

Cache entries and private package installs both go through here, so a reader (or a concurrent fetch) never
sees a half-built directory, and a killed process's leftovers can be recognised by name and removed.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def write_dir_atomic(final: Path, build: Callable[[Path], None], keep_if: str | None = None) -> None:
    """build(tmp) fills a temp sibling of `final`, which is then renamed to `final`. On any failure
    (KeyboardInterrupt included) tmp is removed.

    An existing `final` is replaced, unless keep_if names a file it holds: that marks a complete directory
    left by another process that finished first, and its result is as good as ours.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    # The name pattern is what remove_abandoned_temps recognises.
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-{os.getpid()}-", dir=final.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; these directories are ordinary readable data
        build(tmp)
        _publish(tmp, final, keep_if)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: Path, final: Path, keep_if: str | None) -> None:
    def complete() -> bool:
        return keep_if is not None and (final / keep_if).is_file()

    if complete():
        shutil.rmtree(tmp, ignore_errors=True)
        return
    if not final.exists():
        try:
            os.rename(tmp, final)
            return
        except OSError as exc:  # lost a race to a concurrent process: decide as above
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            if complete():
                shutil.rmtree(tmp, ignore_errors=True)
                return
    # Replace: move the old directory aside first so final is never a mix of old and new files.
    aside = final.with_name(f".old-{final.name}-{os.getpid()}-{time.monotonic_ns()}")
    os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(aside, final)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def remove_abandoned_temps(root: Path, name: str) -> None:
    """Delete temp/aside dirs of `name` under root left by killed processes (SIGKILL skips our cleanup).

    Names are .tmp-NAME-PID-RANDOM / .old-NAME-PID-NS; matching NAME exactly matters, or part1 would
    claim part12's directories and read a bogus pid out of them.
    """
    if not root.is_dir():
        return
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
    except PermissionError:  # it exists, under another user
        pass
    return True
