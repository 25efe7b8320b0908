"""The fastest configuration within a quality budget: among rows with both a perplexity increase (eval) and a
decode speed (bench), those whose increase is at most the budget; the one with the most decode tokens/s wins."""

from toolkit.errors import DataError


def recommend(rows, max_ppl_increase: float) -> tuple[object, list[str]]:
    """(the chosen row, lines explaining the choice). Raises DataError when nothing qualifies."""
    measured = [r for r in rows if r.ppl_increase is not None and r.tokens_per_s and not r.peer]
    if not measured:
        raise DataError("no configuration in the store has both quality (eval) and speed (bench) results",
                        "run `specquant eval` and `specquant bench` on the same model/kv/spec, or eval/sweep.sh")
    within = [r for r in measured if r.ppl_increase <= max_ppl_increase]
    outside = [r for r in measured if r.ppl_increase > max_ppl_increase]
    if not within:
        best_quality = min(measured, key=lambda r: r.ppl_increase)
        raise DataError(f"no configuration is within a perplexity increase of {100 * max_ppl_increase:.2f}% "
                        f"(the smallest is {best_quality.label}: {100 * best_quality.ppl_increase:+.2f}%)",
                        "raise max_ppl_increase or add configurations to the store")
    ranked = sorted(within, key=lambda r: r.tokens_per_s, reverse=True)
    best = ranked[0]
    first = (f"{best.label}: {best.tokens_per_s:.1f} decode tokens/s, perplexity {best.quality['ppl']:.3f} vs "
             f"reference {best.quality['ref_ppl']:.3f} ({100 * best.ppl_increase:+.2f}%, budget "
             f"{100 * max_ppl_increase:.2f}%)")
    why = [first]
    if len(ranked) > 1:
        runner = ranked[1]
        why.append(f"next fastest within budget: {runner.label} at {runner.tokens_per_s:.1f} tokens/s "
                   f"({100 * runner.ppl_increase:+.2f}%): {best.tokens_per_s / runner.tokens_per_s:.2f}x slower")
    faster = [r for r in outside if r.tokens_per_s > best.tokens_per_s]
    for r in sorted(faster, key=lambda r: r.tokens_per_s, reverse=True):
        why.append(f"excluded, faster but over budget: {r.label} at {r.tokens_per_s:.1f} tokens/s "
                   f"({100 * r.ppl_increase:+.2f}%)")
    why.append(f"{len(within)} of {len(measured)} measured configurations are within budget")
    return best, why
