"""The lookup replay (benchmarks/lookup_replay.py): its rounds are the loop's rounds, its costs are measured."""

import pytest

from benchmarks.lookup_replay import RULES, Rule, replay
from toolkit.spec.drafts import LookupDraft


def rows(r: int) -> float:
    return float(r)  # a pass costs one step per token it feeds


def test_a_replayed_round_proposes_what_the_draft_would_and_keeps_the_common_prefix():
    always = Rule("always", LookupDraft(3, 1, scale_by_match=False), 8)
    prompt = [1, 2, 3, 4, 5]
    # round 1 (after the prefill's 6): no earlier "6", a plain step; round 2: "1" matched, the budget leaves room
    # for 4 drafted tokens (5 still to generate, the round's own token included), all 4 kept
    assert replay(always, prompt, [6, 1, 2, 3, 4, 5, 9], rows) == (1 + 5, 2)
    # the same draft with only "2" kept: round 2 feeds 1 + 2 tokens (budget 3) and keeps 1 + 1, round 3 after it
    total, rounds = replay(always, prompt, [6, 1, 2, 7, 8], rows)
    assert (total, rounds) == (1 + 3 + 1, 3)
    oracle = Rule("oracle", None, 8)
    assert replay(oracle, prompt, [6, 1, 2, 7, 8], rows) == (1 + 2 + 1, 3)  # it proposes only the "2" it keeps


def test_the_replay_runs_every_rule_on_a_model_with_measured_costs(tiny_llama_dir):
    from benchmarks.lookup_replay import print_result, run

    out = run(str(tiny_llama_dir), ["code"], n_prompts=2, new_tokens=12)
    assert out["costs"][1] == 1.0 and set(out["costs"]) == set(range(1, 18))
    assert "bf16 native products" not in out["dtype"]  # the engine's default setting
    for rule in RULES:
        assert out["results"][("code", rule.name)]["mean"] > 0
    print_result(out)


def test_the_replay_runs_in_the_bf16_setting_too(tiny_llama_dir):
    """--native-dot bf16: the replay's model runs the bf16 products (engine.native_dot), its costs measured there."""
    from benchmarks.lookup_replay import main, run
    from toolkit.quant import bf16_native

    if not bf16_native.available():
        pytest.skip("bf16 products need the bf16 kernel (AVX512-BF16)")
    out = run(str(tiny_llama_dir), ["code"], n_prompts=1, new_tokens=8, native_dot="bf16")
    assert "bf16 native products" in out["dtype"] and out["costs"][1] == 1.0
    assert out["dtype"].endswith("on AMX") == bf16_native.amx_in_use()  # the name says which path ran
    with pytest.raises(SystemExit):
        main(["--native-dot", "fp16"])
