"""LAMBADA-style cloze: is the passage's last word the model's greedy continuation (every one of its tokens the
argmax), and how likely is it (mean log-probability of the target word)."""

from toolkit.evaluation.reference_scores import score_pairs
from toolkit.kv import KVSpec


def score_cloze(model, tokenizer, items: list[dict], reference=None, max_context: int = 128, batch_size: int = 16,
                kv: KVSpec | None = None, progress=None) -> dict:
    got, ref, stored = score_pairs(model, tokenizer, [(i["context"], i["target"]) for i in items], reference,
                                   max_context, batch_size, kv, progress, "cloze")
    n = len(items)
    return {"ref_from_cache": stored, "cloze_accuracy": sum(r["greedy"] for r in got) / n,
            "ref_cloze_accuracy": sum(r["greedy"] for r in ref) / n,
            "cloze_target_logprob": sum(r["logprob"] for r in got) / n,
            "ref_cloze_target_logprob": sum(r["logprob"] for r in ref) / n,
            "cloze_agreement": sum(a["greedy"] == b["greedy"] for a, b in zip(got, ref)) / n}
