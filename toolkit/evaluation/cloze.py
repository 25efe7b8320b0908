"""LAMBADA-style cloze: is the passage's last word the model's greedy continuation (every one of its tokens the
argmax), and how likely is it (mean log-probability of the target word)."""

from toolkit.evaluation.continuation import encode_pairs, score_continuations
from toolkit.evaluation.reference_scores import cached_reference_scores


def score_cloze(model, tokenizer, items: list[dict], reference=None, max_context: int = 128, batch_size: int = 16,
                kv_cfg=None, progress=None) -> dict:
    encoded = encode_pairs(tokenizer, [(i["context"], i["target"]) for i in items], max_context)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    got = score_continuations(model, encoded, pad, batch_size, kv_cfg, progress)
    ref, stored = got, False
    if reference is not None:
        ref, stored = cached_reference_scores(reference, encoded, batch_size, "cloze", lambda: score_continuations(
            reference, encoded, pad, batch_size, progress=progress))
    n = len(items)
    return {"ref_from_cache": stored, "cloze_accuracy": sum(r["greedy"] for r in got) / n,
            "ref_cloze_accuracy": sum(r["greedy"] for r in ref) / n,
            "cloze_target_logprob": sum(r["logprob"] for r in got) / n,
            "ref_cloze_target_logprob": sum(r["logprob"] for r in ref) / n,
            "cloze_agreement": sum(a["greedy"] == b["greedy"] for a, b in zip(got, ref)) / n}
