"""HellaSwag-style multiple choice: pick the ending with the highest log-probability given the passage.
`mc_accuracy` compares summed log-probabilities (the endings have equal word counts by construction);
`mc_accuracy_norm` divides by each ending's characters (HellaSwag's acc_norm), which removes the pull of shorter
tokenisations."""

from toolkit.evaluation.reference_scores import score_pairs
from toolkit.kv import KVSpec


def _choices(scores: list[dict], items: list[dict], normalise: bool) -> list[int]:
    out, k = [], 0
    for item in items:
        values = [scores[k + j]["logprob"] / (len(e) if normalise else 1) for j, e in enumerate(item["endings"])]
        out.append(max(range(len(values)), key=values.__getitem__))
        k += len(item["endings"])
    return out


def score_choice(model, tokenizer, items: list[dict], reference=None, max_context: int = 128, batch_size: int = 16,
                 kv: KVSpec | None = None, progress=None) -> dict:
    pairs = [(item["context"], ending) for item in items for ending in item["endings"]]
    got, ref, stored = score_pairs(model, tokenizer, pairs, reference, max_context, batch_size, kv, progress, "mc")
    labels = [item["label"] for item in items]
    n = len(items)
    figures = {"ref_from_cache": stored}
    for suffix, norm in (("", False), ("_norm", True)):
        mine, theirs = _choices(got, items, norm), _choices(ref, items, norm)
        figures[f"mc_accuracy{suffix}"] = sum(a == b for a, b in zip(mine, labels)) / n
        figures[f"ref_mc_accuracy{suffix}"] = sum(a == b for a, b in zip(theirs, labels)) / n
        if not norm:
            figures["mc_agreement"] = sum(a == b for a, b in zip(mine, theirs)) / n
    return figures
