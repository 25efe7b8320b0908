"""Quality evaluation: metrics on hand-checkable cases, the KV-cache feeding paths against plain passes, item
building (deterministic, cached, >= 500 items from pydoc), the evaluate modules, and `specquant eval` end to end."""

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from toolkit.errors import InputError
from toolkit.evaluation.continuation import encode_pairs, score_continuations
from toolkit.evaluation.forward import window_logits
from toolkit.evaluation.items import build_cloze, build_mc, load_items, spread
from toolkit.evaluation.metrics import Accumulator, kl_sum, perplexity, target_logprobs, top1_matches
from toolkit.evaluation.perplexity import score_windows
from toolkit.evaluation.suite import resolve_tasks
from toolkit.evaluation.windows import make_windows
from toolkit.kv import KVSpec

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pydoc_texts():
    from toolkit.data import load_text

    return list(load_text("pydoc", "evaluation")["text"])


def test_uniform_logits_give_perplexity_equal_to_vocabulary_size():
    vocab = 37
    logits = torch.zeros(3, 11, vocab)
    targets = torch.randint(0, vocab, (3, 11))
    acc = Accumulator()
    acc.add(logits, logits.clone(), targets)
    assert acc.figures()["ppl"] == pytest.approx(vocab, rel=1e-5)
    assert perplexity(-target_logprobs(logits, targets).sum().item(), targets.numel()) == pytest.approx(vocab)


def test_kl_and_agreement_on_hand_checked_distributions():
    ref = torch.log(torch.tensor([[0.5, 0.5]]))
    got = torch.log(torch.tensor([[0.25, 0.75]]))
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert kl_sum(ref, got) == pytest.approx(expected, rel=1e-5)
    assert kl_sum(ref, ref) == pytest.approx(0.0, abs=1e-7)
    assert top1_matches(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.tensor([[0.0, 1.0], [0.0, 1.0]])) == 1


def test_windows_put_bos_first_and_do_not_overlap(tiny_tokenizer, pydoc_texts):
    windows, protocol = make_windows(tiny_tokenizer, pydoc_texts, window=32, max_windows=5, data="pydoc/evaluation")
    ids = tiny_tokenizer("\n\n".join(pydoc_texts), add_special_tokens=False).input_ids
    assert windows.shape == (5, 32) and (windows[:, 0] == tiny_tokenizer.bos_token_id).all()
    assert windows[:, 1:].reshape(-1).tolist() == ids[:5 * 31]
    assert protocol.scored_tokens == 5 * 31 and "non-overlapping" in protocol.describe()
    assert "BOS id" in protocol.describe()


def test_model_against_itself_scores_kl_zero_and_agreement_one(tiny_model, tiny_tokenizer, pydoc_texts):
    model, _ = tiny_model
    windows, _ = make_windows(tiny_tokenizer, pydoc_texts, window=48, max_windows=3)
    twin = copy.deepcopy(model)  # a different object: the two-model path runs, not the shortcut
    figures = score_windows(model, windows, reference=twin)
    assert figures["kl"] == pytest.approx(0.0, abs=1e-6)
    assert figures["top1_agreement"] == 1.0
    assert figures["ppl"] == pytest.approx(figures["ref_ppl"], rel=1e-6)
    assert score_windows(model, windows) == pytest.approx(figures, rel=1e-6, abs=1e-6)


def test_a_perturbed_model_shows_kl_and_disagreement(tiny_llama_dir, tiny_tokenizer, pydoc_texts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    noisy = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(0.1 * torch.randn_like(p))
    windows, _ = make_windows(tiny_tokenizer, pydoc_texts, window=48, max_windows=3)
    figures = score_windows(noisy, windows, reference=model)
    assert figures["kl"] > 1e-3 and figures["top1_agreement"] < 1.0
    assert figures["ppl"] != pytest.approx(figures["ref_ppl"], rel=1e-3)


def test_feeding_windows_through_the_fp_cache_matches_one_pass(tiny_model, tiny_tokenizer, pydoc_texts):
    model, _ = tiny_model
    windows, _ = make_windows(tiny_tokenizer, pydoc_texts, window=40, max_windows=2)
    whole = window_logits(model, windows)
    chunked = window_logits(model, windows, KVSpec(), chunk=16)
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)


def _plain_scores(model, encoded):
    """Each (context, continuation) as one unpadded sequence in one plain forward pass: what batching, padding,
    the shared prefill and the cache must reproduce."""
    out = []
    for context, continuation in encoded:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([context + continuation]), use_cache=False).logits[0].float()
        pred = logits[len(context) - 1:-1]
        target = torch.tensor(continuation)
        out.append({"logprob": pred.log_softmax(-1).gather(-1, target[:, None]).sum().item(),
                    "greedy": bool((pred.argmax(-1) == target).all())})
    return out


@pytest.mark.parametrize("kv", ["fp", "int8"])
def test_shared_context_scoring_matches_one_plain_pass_per_pair(tiny_model, tiny_tokenizer, kv):
    model, _ = tiny_model
    shared = "Names refer to objects. Names are introduced by name binding"
    pairs = [("The for statement is used to", " iterate"), ("A", " class definition defines a class object"),
             (shared, " operations"), (shared, " statements and more"), (shared, " of"), (shared, " x y z w v"),
             ("Exceptions", " are raised")]
    encoded = encode_pairs(tiny_tokenizer, pairs, max_context=64)
    assert all(c[0] == tiny_tokenizer.bos_token_id for c, _ in encoded)
    plain = _plain_scores(model, encoded)
    # int8 with a residual window longer than any passage: the cache hands back exactly what it stored
    kv = KVSpec("fp") if kv == "fp" else KVSpec.from_node({"kind": "int8", "residual": 128})
    for batch_size in (1, 3, 16):  # a group of four never splits: batch 1 and 3 still hold the shared context whole
        got = score_continuations(model, encoded, tiny_tokenizer.pad_token_id, batch_size, kv)
        for a, b in zip(got, plain):
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-3)
            assert a["greedy"] == b["greedy"]


def test_a_quantized_cache_changes_continuation_scores_when_it_is_read(tiny_model, tiny_tokenizer):
    model, _ = tiny_model
    context = " ".join(["Names refer to objects and are introduced by name binding operations."] * 6)
    encoded = encode_pairs(tiny_tokenizer, [(context, " operations"), (context, " statements")], max_context=64)
    fp = score_continuations(model, encoded, tiny_tokenizer.pad_token_id, 16, KVSpec())
    int2 = score_continuations(model, encoded, tiny_tokenizer.pad_token_id, 16,
                               KVSpec.from_node({"kind": "int2", "residual": 0, "group_size": 16}))
    assert any(abs(a["logprob"] - b["logprob"]) > 1e-3 for a, b in zip(fp, int2))


def test_items_are_deterministic_cached_and_plentiful(pydoc_texts, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECQUANT_HOME", str(tmp_path))
    for task, builder in (("cloze", build_cloze), ("mc", build_mc)):
        items, key = load_items(task, pydoc_texts, "pydoc/evaluation")
        again, key2 = load_items(task, pydoc_texts, "pydoc/evaluation")
        assert key == key2 and items == again == builder(pydoc_texts)
        assert len(items) >= 500, f"{task}: only {len(items)} items from pydoc"
        files = list((tmp_path / "eval-items").glob(f"{task}-*.json"))
        assert len(files) == 1 and key.startswith(files[0].stem.split("-")[1])
    cloze = build_cloze(pydoc_texts)
    assert all(item["target"].strip().isalpha() and item["target"].strip() in item["context"] for item in cloze)
    for item in build_mc(pydoc_texts):
        assert len(item["endings"]) == 4 and len(set(item["endings"])) == 4
        assert len({len(e.split()) for e in item["endings"]}) == 1
    assert load_items("cloze", pydoc_texts[:-1])[1] != load_items("cloze", pydoc_texts)[1]


def test_a_damaged_item_cache_is_rebuilt(pydoc_texts, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECQUANT_HOME", str(tmp_path))
    items, _ = load_items("cloze", pydoc_texts)
    path = next((tmp_path / "eval-items").glob("cloze-*.json"))
    stored = json.loads(path.read_text())
    stored["items"][0]["target"] = " tampered"
    path.write_text(json.dumps(stored))
    assert load_items("cloze", pydoc_texts)[0] == items
    assert json.loads(path.read_text())["items"][0]["target"] != " tampered"


def test_spread_takes_items_from_the_whole_list():
    assert spread(list(range(10)), 5) == [0, 2, 4, 6, 8]
    assert spread(list(range(3)), None) == [0, 1, 2]


def test_task_names():
    assert resolve_tasks("all") == ["ppl", "cloze", "mc", "gen"]
    assert resolve_tasks("kl") == ["ppl"] and resolve_tasks("ppl+cloze") == ["ppl", "cloze"]
    with pytest.raises(InputError):
        resolve_tasks("lambada")


def test_evaluate_module_loads_offline_by_path(tiny_llama_dir, pydoc_texts):
    import evaluate

    module = evaluate.load(str(ROOT / "eval" / "perplexity"))
    out = module.compute(predictions=pydoc_texts, model=str(tiny_llama_dir), window=32, max_windows=2,
                         engine={"dtype": "fp32", "threads": 1})
    assert out["ppl"] == pytest.approx(out["ref_ppl"]) and out["kl"] == 0.0  # fp32 float: its own reference
    assert out["protocol"]["windows"] == 2 and out["protocol"]["bos_token_id"] is not None


def _specquant(*args, env=None):
    return subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})})


def test_eval_cli_writes_ppl_reference_and_protocol(tiny_llama_dir, tmp_path):
    out, store = tmp_path / "e.json", tmp_path / "results.jsonl"
    run = _specquant("eval", f"model={tiny_llama_dir}", "task=all", "window=48", "max_windows=2", "items=6",
                     "gen_prompts=2", "gen_new_tokens=4", "engine.threads=1", f"out={out}", f"store={store}",
                     env={"SPECQUANT_HOME": str(tmp_path / "home")})
    assert run.returncode == 0, run.stderr + run.stdout
    result = json.loads(out.read_text())
    for key in ("ppl", "ref_ppl", "kl", "top1_agreement", "cloze_accuracy", "mc_accuracy", "gen_prefix_match"):
        assert isinstance(result[key], float), key
    assert result["kind"] == "eval" and result["config"]["model"]["name"] == str(tiny_llama_dir)
    assert result["protocol"]["ppl"]["window"] == 48 and "BOS" in result["protocol"]["ppl"]["text"]
    assert result["protocol"]["cloze"]["items"] == 6 and "machine" in result and "git_revision" in result
    assert "protocol" in run.stdout and "perplexity" in run.stdout
    lines = store.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["ppl"] == result["ppl"]


def test_eval_cli_rejects_an_unknown_task(tiny_llama_dir, tmp_path):
    run = _specquant("eval", f"model={tiny_llama_dir}", "task=bogus", "store=none")
    assert run.returncode == 2 and "unknown task" in run.stderr


def test_a_quantized_kv_cache_is_read_back_and_shows_in_the_figures(tiny_llama_dir, tiny_tokenizer, pydoc_texts):
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from toolkit.evaluation.suite import Settings, run_tasks
    from toolkit.kv import KINDS

    if "int2" not in KINDS:
        pytest.skip("no quantized KV cache kinds in toolkit.kv yet")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    settings = Settings(window=48, max_windows=2, chunk=128)  # chunk > window: clamped so the cache is read
    # a short full-precision residual so 48-token windows reach the quantized part (the default keeps 128 tokens)
    kv = KVSpec.from_node(OmegaConf.create({"kind": "int2", "bits": 2, "group_size": 8, "residual": 8}))
    out = run_tasks(model, tiny_tokenizer, pydoc_texts, ["ppl"], settings, reference=model, kv=kv,
                    log=lambda line: None)
    assert out["protocol"]["ppl"]["chunk"] == 24 and out["protocol"]["ppl"]["kv"] == "int2"
    assert out["figures"]["kl"] > 1e-4


def test_reference_scores_are_cached_keyed_by_weights_and_rescored_when_damaged(tiny_llama_dir, tiny_tokenizer,
                                                                                tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM

    from toolkit.evaluation.reference_scores import cached_reference_scores

    monkeypatch.setenv("SPECQUANT_HOME", str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    encoded = encode_pairs(tiny_tokenizer, [("The for statement is used to", " iterate"), ("A", " class")], 64)
    calls = []

    def score(m):
        calls.append(1)
        return score_continuations(m, encoded, tiny_tokenizer.pad_token_id, 4)

    first, hit = cached_reference_scores(model, encoded, 4, "cloze", lambda: score(model))
    again, hit2 = cached_reference_scores(model, encoded, 4, "cloze", lambda: score(model))
    assert (hit, hit2, len(calls)) == (False, True, 1) and again == first
    # another batch size, other rows or other weights: not the same scores
    assert not cached_reference_scores(model, encoded, 2, "cloze", lambda: score(model))[1]
    assert not cached_reference_scores(model, encoded[:1], 4, "cloze", lambda: score(model))[1]
    with torch.no_grad():
        model.model.norm.weight.mul_(1.01)
    changed, hit3 = cached_reference_scores(model, encoded, 4, "cloze", lambda: score(model))
    assert not hit3 and changed != first
    path = max((tmp_path / "eval-items" / "reference-scores").glob("cloze-*.json"), key=lambda p: p.stat().st_mtime)
    stored = json.loads(path.read_text())
    stored["scores"][0]["logprob"] += 1.0
    path.write_text(json.dumps(stored))
    rescored, hit4 = cached_reference_scores(model, encoded, 4, "cloze", lambda: score(model))
    assert not hit4 and rescored == changed and "damaged" in capsys.readouterr().err
