"""From the `spec` config group (conf/spec/) to a draft and a draft-length policy.

    spec=none     no speculation
    spec=lookup   prompt lookup (n-grams of prompt + output)
    spec=self     the target's own weights: first `layers` layers (null = all), `bits`-bit RTN weights (null = the
                  target's), its own `kv` cache kind
    spec=draft    a separate model with the target's tokenizer (`model`: registry name, directory or a quantized
                  checkpoint), loaded under the same engine config as the target
"""

from toolkit.engine.lean_forward import LeanForward
from toolkit.engine.sampling import SamplingParams
from toolkit.engine.setup import load_engine_model
from toolkit.errors import InputError
from toolkit.spec.config import KINDS, SpecConfig  # noqa: F401 (KINDS: the spec group's kinds)
from toolkit.spec.decode import DraftLength
from toolkit.spec.draft_head import quantize_draft_head
from toolkit.spec.draft_vocab import frequent_tokens
from toolkit.spec.drafts import LookupDraft, ModelDraft
from toolkit.spec.self_draft import build_self_draft, describe


def spec_kind(spec_cfg) -> str:
    return SpecConfig.of(spec_cfg).kind


def draft_length(spec_cfg) -> DraftLength:
    spec = SpecConfig.of(spec_cfg)
    return DraftLength(k=spec.k, adaptive=spec.adaptive, k_min=spec.k_min, k_max=spec.k_max)


def lookup_draft(spec_cfg) -> LookupDraft:
    """The prompt-lookup draft a `spec=lookup` node describes (a bare kind name gets the conf defaults)."""
    spec = SpecConfig.of(spec_cfg)
    return LookupDraft(spec.ngram_max, spec.ngram_min, spec.scale_by_match, spec.agree_tokens, spec.doubt_k)


def build_draft(spec_cfg, target, tokenizer, sampling: SamplingParams | None = None, engine=None):
    """The draft `spec_cfg` (a SpecConfig, a spec node or a kind name) describes, for `target` (a prepared engine
    model) and its tokenizer; None for none. `engine`: the EngineSpec a spec=draft model is loaded with."""
    spec = SpecConfig.of(spec_cfg)
    if spec.kind == "none":
        return None
    if spec.kind == "lookup":
        return lookup_draft(spec)
    common = {"sampling": sampling or SamplingParams(), "target_vocab": _vocab(target), "kv": spec.kv,
              "min_confidence": float(spec.min_confidence or 0.0)}
    if spec.kind == "self":

        bits = None if spec.bits in (None, 0, 16) else int(spec.bits)
        model = build_self_draft(target, spec.layers, bits, int(spec.group_size))
        _draft_head(spec, model, tokenizer)
        _draft_activations(spec, model)
        return ModelDraft(model, share_kv=bool(spec.share_kv), **common)
    if not spec.model:
        raise InputError("spec=draft needs a draft model", "set spec.model=NAME (a registry name, a directory or a "
                                                           "quantized checkpoint with the target's tokenizer)")

    if engine is None:
        raise InputError("spec=draft needs the engine settings to load its model", "pass engine=EngineSpec")
    loaded = load_engine_model(str(spec.model), engine)
    _draft_head(spec, loaded.model, tokenizer)
    _draft_activations(spec, loaded.model)
    return ModelDraft(loaded.model, target_tokenizer=tokenizer, draft_tokenizer=loaded.tokenizer, **common)


def _act_bits(spec: SpecConfig) -> int | None:
    """spec.act_bits: 8 (the draft's int4 products take int8 activations, `toolkit.quant.vnni`) or None."""
    return None if spec.act_bits in (None, 0, 32) else 8


def _draft_head(spec: SpecConfig, model, tokenizer) -> None:
    """spec.head_bits: the draft's own RTN-quantized output head (toolkit/spec/draft_head.py); spec.head_vocab: over
    the most frequent tokens only (toolkit/spec/draft_vocab.py)."""
    bits, size = spec.head_bits, spec.head_vocab
    if bits in (None, 0, 16):
        if size:
            raise InputError(f"spec.head_vocab={size} needs the draft's own quantized head",
                             "set spec.head_bits=8 (or 4), or spec.head_vocab=null")
        return

    vocab = frequent_tokens(tokenizer, int(size), _vocab(model)) if size else None
    quantize_draft_head(model, int(bits), int(spec.head_group_size), _act_bits(spec), vocab)


def _draft_activations(spec: SpecConfig, model) -> None:
    """spec.act_bits=8: the draft's native int4 decoder stack (a self-draft's int4 layers, an int4 checkpoint's) runs
    the w4a8 kernel where the CPU has AVX512-VNNI; elsewhere, and for float drafts, nothing changes."""
    if _act_bits(spec) == 8:

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

    return describe(draft.model) + (", target's KV" if getattr(draft, "share_kv", False) else "")
