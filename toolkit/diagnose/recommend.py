"""The one recommendation: of the measured options within the quality budget, the one that most cuts the workload's
dominant metric (TTFT when prefill dominates, mean ITL when decode does), if it cuts it by more than the noise
margin; else keep the baseline. Every figure it cites was measured in this run, side by side with the baseline."""

METRIC = {"prefill": "ttft_ms", "decode": "itl_ms"}


def rank(rows: dict[str, dict]) -> list[str]:
    """Option names, fastest end to end first."""
    return sorted(rows, key=lambda name: rows[name]["e2e_ms"])


def recommend(rows: dict[str, dict], dominant: str, kl_budget: float, min_gain: float, apply: dict[str, str],
              base_command: str) -> dict:
    """`rows`: per option its split (ttft_ms, itl_ms, e2e_ms) and quality (kl); `apply`: the command per option."""
    metric = METRIC[dominant]
    base = rows["baseline"][metric]
    candidates = [n for n in rows if n != "baseline" and rows[n]["kl"] <= kl_budget
                  and rows[n][metric] < base * (1 - min_gain)]
    rejected = [n for n in rows if n != "baseline" and rows[n]["kl"] > kl_budget]
    if not candidates:
        return {"option": "baseline", "metric": metric, "baseline": base, "value": base, "gain": 0.0,
                "command": base_command, "explain": "",
                "why": f"no measured option cut {metric} by more than {min_gain:.0%} within KL <= {kl_budget}"
                       + (f" ({', '.join(rejected)} over the quality budget)" if rejected else "")
                       + ": keep the current settings"
                       + ("; the prompt is the cost: send fewer prompt tokens" if dominant == "prefill" else "")}
    best = min(candidates, key=lambda n: rows[n][metric])
    value = rows[best][metric]
    return {"option": best, "metric": metric, "baseline": base, "value": value, "gain": 1 - value / base,
            "command": apply[best], "explain": rows[best].get("explain", ""),
            "why": f"{dominant} dominates; {best} cuts {metric} from {base:.1f} to {value:.1f} ms "
                   f"({1 - value / base:.0%} less) at KL {rows[best]['kl']:.4f} <= {kl_budget}"}
