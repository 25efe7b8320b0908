"""Runs one subcommand as a hydra app, and turns user-facing errors into one clear message and exit code 2."""

import functools
import importlib
import sys
from pathlib import Path

from toolkit.errors import SpecquantError
from toolkit.paths import RECIPES_DIR, recipe_path  # noqa: F401 (RECIPES_DIR: the CLI's name for it)

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


@functools.cache
def register_schemas() -> None:
    """Register the typed engine settings in hydra's ConfigStore as `engine/schema`, which conf/engine/*.yaml
    extend: a value of the wrong type (engine.threads=abc) or an unknown key fails while hydra composes, and
    EngineSpec.from_node checks the choices. EngineSpec is frozen once resolved, but its schema node must take
    the YAML merged onto it, so the node is made writable. Called before composing a command whose config has an
    engine (it loads torch, which `specquant models list` does without)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from toolkit.engine.spec import EngineSpec

    schema = OmegaConf.structured(EngineSpec)
    OmegaConf.set_readonly(schema, False)
    ConfigStore.instance().store(group="engine", name="schema", node=schema)


def uses_engine(command: str) -> bool:
    return "- engine:" in (CONF_DIR / f"{command}.yaml").read_text()

# Subcommands whose first positional word is an action, and which config group the word after it selects.
_ACTIONS = {"models": "model", "data": "data"}


def group_options(group: str) -> set[str]:
    return {p.stem for p in (CONF_DIR / group).glob("*.yaml")}


def translate_argv(command: str, argv: list[str]) -> list[str]:
    """Positional words -> overrides; `model=DIR` -> `model.name=DIR` (hydra would look for a config named DIR)."""
    out, positional = [], []
    for arg in argv:
        if arg.startswith("-") or "=" in arg:
            out.append(arg)
        else:
            positional.append(arg)
    if positional:
        group = _ACTIONS.get(command)
        if group is None or len(positional) > 2:
            raise SpecquantError(f"unexpected argument(s) {' '.join(positional)!r} for `specquant {command}`",
                                 "options are key=value pairs; see `specquant {command} --help`")
        out.insert(0, f"action={positional[0]}")
        if len(positional) == 2:
            out.append(f"{group}={positional[1]}")
    return [_group_value(arg) for arg in _expand_recipe(out)]


def _expand_recipe(overrides: list[str]) -> list[str]:
    """`recipe=PATH` -> the recipe's keys as overrides, placed first so the rest of the command line wins."""
    paths = [arg.partition("=")[2] for arg in overrides if arg.startswith("recipe=")]
    if not paths:
        return overrides
    from omegaconf import OmegaConf

    path = recipe_path(paths[-1])
    try:
        recipe = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as exc:  # a YAML error of any kind: name the file
        raise SpecquantError(f"recipe {path} is not valid YAML: {exc}", "fix the file or copy a recipe from recipes/")
    if not isinstance(recipe, dict):
        raise SpecquantError(f"recipe {path} is not a mapping of keys", "copy a recipe from recipes/ and edit it")
    # hydra refuses two values for one key: the command line's value replaces the recipe's
    merged = {arg.partition("=")[0]: arg for arg in _flatten(recipe)}
    for arg in overrides:
        key = arg.partition("=")[0]
        merged.pop(key, None)
        merged[key] = arg
    return list(merged.values())


def _flatten(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out.extend(_flatten(value, f"{prefix}{key}."))
        else:
            out.append(f"{prefix}{key}={'null' if value is None else value}")
    return out


def _group_value(arg: str) -> str:
    key, _, value = arg.partition("=")
    if key == "baseline" and "," in value and value[:1] not in "'\"[":
        return f"baseline='{value}'"  # one value naming two baselines (hf,llamacpp), not a hydra sweep over two
    group = key.lstrip("+~")
    if group not in ("model", "data") or not value:
        return arg
    # a group config holds only the name (and data's default split), so a sweep over a mix of config names and
    # directories is a sweep over `.name`
    unknown = [p for p in value.split(",") if p not in group_options(group)]
    return f"{group}.name={value}" if unknown else arg


def run_command(command: str, argv: list[str]) -> None:
    import hydra

    try:
        overrides = translate_argv(command, argv)
    except SpecquantError as err:
        _fail(err)
    module = importlib.import_module(f"toolkit.cli.{command}")

    def task(cfg):
        try:
            return module.run(cfg)
        except SpecquantError as err:
            _fail(err)

    if uses_engine(command):
        register_schemas()
    sys.argv = [f"specquant {command}", *overrides]
    hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=command)(task)()


def _fail(err: SpecquantError) -> None:
    from rich.console import Console

    console = Console(stderr=True)
    console.print(f"[bold red]error:[/] {err.problem}", highlight=False)
    if err.fix:
        console.print(f"[bold]fix:[/] {err.fix}", highlight=False)
    sys.exit(2)
