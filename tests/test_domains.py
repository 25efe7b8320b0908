"""The domains quality is measured on (toolkit/data/chat.py): chat conversations made from each source's own split
(so calibration and evaluation stay disjoint) and rendered with the model's chat template, the `mix` calibration
set drawing from prose, docs, code and chat in turn, and `specquant eval data=domains` scoring each domain with the
worst at the head of the result."""

import copy
import json

import pytest

from tests.test_cli import specquant
from toolkit.data import CALIBRATION, EVALUATION, cache
from toolkit.data.chat import DOMAINS, conversations, domain_texts, render
from toolkit.data.documents import Document
from toolkit.errors import InputError
from toolkit.quant.calibration_data import calibration_batches

EMMA = "Emma Woodhouse, handsome, clever, and rich.\n\nShe was the youngest of the two daughters.\n\nHer mother died."
PERSUASION = "Sir Walter Elliot, of Kellynch Hall.\n\nVanity was the beginning and the end.\n\nHe had been remarkably handsome."


@pytest.fixture
def austen(tmp_path, monkeypatch):
    """A small Austen cache in a fresh home: one calibration chapter (Emma), one evaluation chapter (Persuasion)."""
    monkeypatch.setenv("SPECQUANT_HOME", str(tmp_path))
    cache.write_cache("austen", [Document("Emma, chapter 1", EMMA * 40, "Emma"),
                                 Document("Persuasion, chapter 1", PERSUASION * 40, "Persuasion")], "test")
    return tmp_path


def test_chat_is_made_from_each_sources_own_split(austen):
    calibration, evaluation = conversations(CALIBRATION), conversations(EVALUATION)
    assert len(calibration) == len(evaluation) == 3  # one of each kind: the fewest a source gives (Austen's one)
    for convs in (calibration, evaluation):
        assert all([m["role"] for m in c] == ["user", "assistant"] for c in convs)
        asked = " ".join(c[0]["content"] for c in convs)
        assert "documentation say" in asked and "Continue this passage" in asked and "```" not in asked
        assert any(c[1]["content"].startswith("```python") for c in convs)
    answers = {c[1]["content"] for c in calibration}
    assert not answers & {c[1]["content"] for c in evaluation}
    assert "Emma Woodhouse" in " ".join(answers) + " ".join(c[0]["content"] for c in calibration)
    assert "Sir Walter" not in " ".join(answers) + " ".join(c[0]["content"] for c in calibration)


def test_conversations_are_rendered_with_the_models_template(tiny_tokenizer):
    conv = [[{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]]
    assert render(tiny_tokenizer, conv) == ["User: Hi?\n\nAssistant: Hello."]  # no template: plain turns
    tok = copy.deepcopy(tiny_tokenizer)  # with a template, as an instruct model's has
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    assert render(tok, conv) == ["<|user|>Hi?\n<|assistant|>Hello.\n"]


def test_mix_draws_prose_docs_code_and_chat_in_turn(tmp_path, monkeypatch, tiny_tokenizer):
    """Window i of the mix is the next window of domain i % 4, as that source alone would give it; the Austen text
    is fetched on first use, once (here a stand-in for the Debian download), as a model is."""
    import toolkit.data.chat as chat

    monkeypatch.setenv("SPECQUANT_HOME", str(tmp_path))
    calls = []

    def fake_fetch(name):
        calls.append(name)
        cache.write_cache(name, [Document("Emma, chapter 1", EMMA * 40, "Emma"),
                                 Document("Persuasion, chapter 1", PERSUASION * 40, "Persuasion")], "test")

    monkeypatch.setattr(chat, "fetch", fake_fetch)
    windows = calibration_batches(tiny_tokenizer, "mix", n_samples=8, seq_len=1024, add_bos=False)
    domain_texts("chat", EVALUATION, tiny_tokenizer)
    assert calls == ["austen"] and list(DOMAINS) == ["prose", "docs", "code", "chat"]
    texts = [tiny_tokenizer.decode(w) for w in windows]
    for i, source in enumerate(DOMAINS.values()):
        if source != "stdlib-code":  # (the largest split to tokenize again; its turn is the same code)
            alone = calibration_batches(tiny_tokenizer, source, n_samples=2, seq_len=1024, add_bos=False)
            assert windows[i].equal(alone[0]) and windows[i + 4].equal(alone[1])
    assert "Emma" in texts[0] or "Woodhouse" in texts[0]
    assert "def " in texts[2] + texts[6] or "import " in texts[2] + texts[6]
    assert "User:" in texts[3] and "User:" in texts[7]  # a window is longer than a conversation


def test_domain_texts_name_a_domain_or_a_dataset(austen, tiny_tokenizer):
    assert domain_texts("prose", EVALUATION, tiny_tokenizer) == domain_texts("austen", EVALUATION, tiny_tokenizer)
    assert domain_texts("docs", CALIBRATION, tiny_tokenizer)[0].strip()


def test_eval_scores_every_domain_and_heads_with_the_worst(austen, tiny_llama_dir, tmp_path):
    out = tmp_path / "e.json"
    env = {"SPECQUANT_HOME": str(austen)}
    run = specquant("eval", f"model={tiny_llama_dir}", "task=ppl", "data=domains", "window=64", "max_windows=2",
                    "kv=int4", "kv.residual=8", "kv.group_size=16", "chunk=16", f"out={out}", "store=none", env=env)
    assert run.returncode == 0, run.stderr
    figures = json.loads(out.read_text())
    domains = figures["domains"]
    assert list(domains) == list(DOMAINS) and figures["data"] == "domains/evaluation"
    worst = max(domains, key=lambda d: domains[d]["ppl_increase"])
    assert figures["worst_domain"] == worst and figures["ppl"] == domains[worst]["ppl"]
    assert domains["chat"]["data"] == "chat/evaluation" and "worst domain" in run.stdout


def test_domains_take_perplexity_only():
    from hydra import compose, initialize_config_dir

    from toolkit.cli.app import CONF_DIR
    from toolkit.cli.eval import evaluate_model

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("eval", overrides=["task=all", "data=domains"])
    with pytest.raises(InputError, match="perplexity only") as err:
        evaluate_model(cfg)  # refused before any model loads
    assert "task=ppl" in err.value.fix

