"""The `spec` config group (conf/spec/*.yaml) resolved once into a typed, validated object (docs/speculative.md).

The YAML files are the one source of the defaults a user runs: a node composed by hydra carries all of its kind's
keys, and a bare kind name (`"lookup"`) loads its file. The dataclass defaults fill only what a node leaves out: the
keys its kind does not use (a lookup node has no `bits`), and, for a partial dict built in code, the library's plain
choices (no shared KV, no draft head, fp32 activations), which the YAML's tuned ones (spec=self) may override.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.errors import InputError
from toolkit.kv.config import KVSpec
from toolkit.settings import check_kind, node_values, refuse_unknown

KINDS = ("none", "lookup", "self", "draft")
_CONF = Path(__file__).resolve().parent.parent / "conf" / "spec"


@dataclass(frozen=True)
class SpecConfig:
    kind: str = "none"
    # every kind: the draft length policy (toolkit.spec.decode.DraftLength)
    k: int = 4
    adaptive: bool = False
    k_min: int = 1
    k_max: int = 8
    # lookup (toolkit.spec.drafts.LookupDraft)
    ngram_max: int = 3
    ngram_min: int = 1
    scale_by_match: bool = True
    agree_tokens: int = 4
    doubt_k: int = 2
    # model drafts: self (the target's own weights) and draft (another model)
    model: str | None = None
    layers: int | None = None
    bits: int | None = 4
    group_size: int = 64
    kv: KVSpec = field(default_factory=KVSpec)  # the draft's own KV cache (conf/kv/: a kind or a kv node)
    share_kv: bool = False
    min_confidence: float = 0.0
    head_bits: int | None = None
    act_bits: int | None = None
    head_group_size: int = 64
    head_vocab: int | None = None

    @classmethod
    def of(cls, node) -> SpecConfig:
        """From a spec node (hydra's DictConfig or a dict), a kind name, None (no speculation) or a SpecConfig."""
        if isinstance(node, SpecConfig):
            return node
        if node is None:
            return cls()
        if isinstance(node, str):
            check_kind(node, KINDS, "speculative decoding kind", "spec")
            node = _load(node)
        values = node_values(node)
        kind = values.get("kind", "none")
        check_kind(kind, KINDS, "speculative decoding kind", "spec")
        refuse_unknown(values, (f.name for f in dataclasses.fields(cls)), "spec",
                       f"see conf/spec/{kind}.yaml for what spec={kind} takes")
        spec = cls(**{**values, "kv": KVSpec.from_node(values.get("kv"))})
        spec.check()
        return spec

    def check(self) -> None:
        if min(self.k, self.k_min, self.k_max) < 1 or not self.k_min <= self.k_max:
            raise InputError(f"spec draft lengths must be >= 1 with k_min <= k_max, got k={self.k} "
                             f"k_min={self.k_min} k_max={self.k_max}", "fix spec.k / spec.k_min / spec.k_max")
        if self.act_bits not in (None, 0, 8, 32):
            raise InputError(f"spec.act_bits must be 8 or null, got {self.act_bits}",
                             "use spec.act_bits=8, or null for fp32")


def _load(kind: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(_CONF / f"{kind}.yaml"), resolve=True)
