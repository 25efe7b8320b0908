"""Where specquant keeps what it downloads and converts."""

import os
from pathlib import Path


def home() -> Path:
    """The cache root: $SPECQUANT_HOME, else ~/.cache/specquant."""
    return Path(os.environ.get("SPECQUANT_HOME") or Path.home() / ".cache" / "specquant").expanduser()


def models_dir() -> Path:
    return home() / "models"


def data_dir() -> Path:
    return home() / "data"


def packages_dir() -> Path:
    """Where `models fetch` / `data fetch` install carrier packages (pip --target), apart from the user's env."""
    return home() / "packages"
