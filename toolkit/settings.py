"""What the typed settings (EngineSpec, KVSpec, SpecConfig) share when they resolve a config node at the CLI
boundary: the node as a plain dict, and one error for keys the settings do not have (docs/architecture.md,
"Configuration resolved once")."""

from toolkit.errors import InputError


def node_values(node) -> dict:
    """A hydra node (resolved) or any mapping, as a plain dict the caller may change."""
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def refuse_unknown(values: dict, known, what: str, fix: str) -> None:
    """InputError naming every key of `values` not in `known` (`what`: "engine", "kv", "spec")."""
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise InputError(f"unknown {what} option(s) {', '.join(unknown)}", fix)


def check_kind(kind, kinds, what: str, key: str) -> None:
    """InputError unless `kind` is one of `kinds` (`what`: "KV cache kind"; `key`: the override, "kv")."""
    if kind not in kinds:
        raise InputError(f"unknown {what} {kind!r}", f"use {key}= one of {', '.join(kinds)}")
