"""Runs one subcommand as a hydra app, and turns user-facing errors into one clear message and exit code 2."""

import importlib
import sys
from pathlib import Path

from toolkit.errors import SpecquantError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

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
    return [_group_value(arg) for arg in out]


def _group_value(arg: str) -> str:
    key, _, value = arg.partition("=")
    group = key.lstrip("+~")
    if group in ("model", "data") and value and "," not in value and value not in group_options(group):
        return f"{group}.name={value}"
    return arg


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

    sys.argv = [f"specquant {command}", *overrides]
    hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=command)(task)()


def _fail(err: SpecquantError) -> None:
    from rich.console import Console

    console = Console(stderr=True)
    console.print(f"[bold red]error:[/] {err.problem}", highlight=False)
    if err.fix:
        console.print(f"[bold]fix:[/] {err.fix}", highlight=False)
    sys.exit(2)
