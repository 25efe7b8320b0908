"""From the `spec` config group (conf/spec/) to a draft and a draft-length policy.

    spec=none     no speculation
    spec=lookup   prompt lookup (n-grams of prompt + output)
    spec=self     the target's own weights: first `layers` layers (null = all), `bits`-bit RTN weights (null = the
                  target's), its own `kv` cache kind
    spec=draft    a separate model with the target's tokenizer (`model`: registry name, directory or a quantized
                  checkpoint), loaded under the same engine config as the target
"""

from omegaconf import DictConfig, OmegaConf

from toolkit.engine.sampling import SamplingParams
from toolkit.errors import InputError
from toolkit.spec.decode import DraftLength
from toolkit.spec.drafts import LookupDraft, ModelDraft

KINDS = ("none", "lookup", "self", "draft")


def spec_kind(spec_cfg) -> str:
    kind = "none" if spec_cfg is None else (spec_cfg if isinstance(spec_cfg, str) else spec_cfg.get("kind", "none"))
    if kind not in KINDS:
        raise InputError(f"unknown speculative decoding kind {kind!r}", f"use spec= one of {', '.join(KINDS)}")
    return kind


def _get(cfg, key, default=None):
    if isinstance(cfg, (dict, DictConfig)):
        value = cfg.get(key, default)
        return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value
    return default


def draft_length(spec_cfg) -> DraftLength:
    return DraftLength(k=int(_get(spec_cfg, "k", 4)), adaptive=bool(_get(spec_cfg, "adaptive", False)),
                       k_min=int(_get(spec_cfg, "k_min", 1)), k_max=int(_get(spec_cfg, "k_max", 8)))


def lookup_draft(spec_cfg) -> LookupDraft:
    """The prompt-lookup draft a `spec=lookup` node describes (a bare kind name gets the defaults)."""
    return LookupDraft(int(_get(spec_cfg, "ngram_max", 3)), int(_get(spec_cfg, "ngram_min", 1)),
                       bool(_get(spec_cfg, "scale_by_match", True)), int(_get(spec_cfg, "agree_tokens", 4)),
                       int(_get(spec_cfg, "doubt_k", 2)))


def build_draft(spec_cfg, target, tokenizer, sampling: SamplingParams | None = None, engine_cfg=None):
    """The draft `spec_cfg` describes, for `target` (a prepared engine model) and its tokenizer; None for none."""
    kind = spec_kind(spec_cfg)
    if kind == "none":
        return None
    if kind == "lookup":
        return lookup_draft(spec_cfg)
    common = {"sampling": sampling or SamplingParams(), "target_vocab": _vocab(target), "kv": _get(spec_cfg, "kv"),
              "min_confidence": float(_get(spec_cfg, "min_confidence", 0.0) or 0.0)}
    if kind == "self":
        from toolkit.spec.self_draft import build_self_draft

        bits = _get(spec_cfg, "bits", 4)
        model = build_self_draft(target, _get(spec_cfg, "layers"), None if bits in (None, 0, 16) else int(bits),
                                 int(_get(spec_cfg, "group_size", 64)))
        _draft_head(spec_cfg, model, tokenizer)
        _draft_activations(spec_cfg, model)
        return ModelDraft(model, share_kv=bool(_get(spec_cfg, "share_kv", False)), **common)
    name = _get(spec_cfg, "model")
    if not name:
        raise InputError("spec=draft needs a draft model", "set spec.model=NAME (a registry name, a directory or a "
                                                           "quantized checkpoint with the target's tokenizer)")
    from toolkit.engine.setup import load_engine_model

    if engine_cfg is None:
        raise InputError("spec=draft needs the engine config to load its model", "pass engine_cfg")
    loaded = load_engine_model(str(name), engine_cfg)
    _draft_head(spec_cfg, loaded.model, tokenizer)
    _draft_activations(spec_cfg, loaded.model)
    return ModelDraft(loaded.model, target_tokenizer=tokenizer, draft_tokenizer=loaded.tokenizer, **common)


def _act_bits(spec_cfg) -> int | None:
    """spec.act_bits: 8 (the draft's int4 products take int8 activations, `toolkit.quant.vnni`) or None."""
    bits = _get(spec_cfg, "act_bits")
    if bits in (None, 0, 32):
        return None
    if int(bits) != 8:
        raise InputError(f"spec.act_bits must be 8 or null, got {bits}", "use spec.act_bits=8, or null for fp32")
    return 8


def _draft_head(spec_cfg, model, tokenizer) -> None:
    """spec.head_bits: the draft's own RTN-quantized output head (toolkit/spec/draft_head.py); spec.head_vocab: over
    the most frequent tokens only (toolkit/spec/draft_vocab.py)."""
    bits = _get(spec_cfg, "head_bits")
    size = _get(spec_cfg, "head_vocab")
    if bits in (None, 0, 16):
        if size:
            raise InputError(f"spec.head_vocab={size} needs the draft's own quantized head",
                             "set spec.head_bits=8 (or 4), or spec.head_vocab=null")
        return
    from toolkit.spec.draft_head import quantize_draft_head
    from toolkit.spec.draft_vocab import frequent_tokens

    vocab = frequent_tokens(tokenizer, int(size), _vocab(model)) if size else None
    quantize_draft_head(model, int(bits), int(_get(spec_cfg, "head_group_size", 64)), _act_bits(spec_cfg), vocab)


def _draft_activations(spec_cfg, model) -> None:
    """spec.act_bits=8: the draft's native int4 decoder stack (a self-draft's int4 layers, an int4 checkpoint's) runs
    the w4a8 kernel where the CPU has AVX512-VNNI; elsewhere, and for float drafts, nothing changes."""
    if _act_bits(spec_cfg) == 8:
        from toolkit.engine.lean_forward import LeanForward

        forward = model.__dict__.get("forward")
        if isinstance(forward, LeanForward):
            forward.use_activations("int8")


def _vocab(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def describe_draft(draft) -> str:
    if draft is None:
        return "none"
    if isinstance(draft, LookupDraft):
        return draft.describe()
    from toolkit.spec.self_draft import describe

    return describe(draft.model) + (", target's KV" if getattr(draft, "share_kv", False) else "")
