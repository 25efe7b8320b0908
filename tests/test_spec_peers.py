"""transformers' assisted generation as the peer of speculative decoding (toolkit/bench/peers.py): prompt lookup and a
draft model each run greedy and match transformers' plain generate; a quantized draft checkpoint's peer runs the float
model it was made from."""

import pytest
import torch

from toolkit.spec.decode import DraftLength

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_transformers_assisted_lookup_peer_runs_greedy_and_matches_its_plain_generate(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from toolkit.bench.peers import assisted_lookup_peer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    repetitive = [5, 6, 7, 8, 9, 10] * 6  # n-grams to look up
    peer = assisted_lookup_peer(model, [repetitive, list(range(20, 60))], new_tokens=12, k=4, repeats=1, warmup=0)
    assert peer["identical_outputs"] is True and peer["k"] == 4
    for path in ("generate", "assisted"):
        assert peer[path]["runs"] == 2 and peer[path]["tokens_per_s"] > 0 and peer[path]["ttft_ms"] > 0
    assert peer["speedup_vs_generate"] > 0


def test_transformers_assisted_draft_peer_runs_the_draft_model_and_matches_its_plain_generate(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from toolkit.bench.peers import assisted_draft_peer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    assistant = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    calls = []
    assistant.register_forward_hook(lambda *args: calls.append(1))
    peer = assisted_draft_peer(model, assistant, [list(range(20, 60))], new_tokens=12, repeats=1, warmup=0)
    assert peer["identical_outputs"] is True and calls  # the assistant really drafted
    assert peer["assistant_settings"]["num_assistant_tokens"] == 20  # transformers' default, reported as such
    for path in ("generate", "assisted"):
        assert peer[path]["runs"] == 1 and peer[path]["tokens_per_s"] > 0


def test_the_assisted_peer_of_a_quantized_draft_checkpoint_runs_the_float_model_it_was_made_from(
        tiny_llama_dir, tiny_tokenizer, tmp_path, monkeypatch):
    """spec=draft with one of our int4 checkpoints: transformers' assisted generation gets the same pair as it can
    run it, the checkpoint's float source (from its manifest), not no peer at all."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    import toolkit.bench.spec as bench_spec
    from toolkit.bench.spec import _peer
    from toolkit.quant.checkpoint import save_quantized
    from toolkit.quant.model_quant import QuantRecipe, quantize_model

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    qsd = quantize_model(model, QuantRecipe(method="rtn", bits=4, group_size=32))
    ck = save_quantized(tmp_path / "ck", model, qsd, tokenizer=tiny_tokenizer, source=str(tiny_llama_dir))
    seen = {}

    def fake_peer(target, assistant, *args, **kwargs):
        seen["assistant"] = assistant
        return {"identical_outputs": True}

    monkeypatch.setattr(bench_spec, "assisted_draft_peer", fake_peer)
    spec_cfg = OmegaConf.create({"kind": "draft", "model": str(ck)})
    result = _peer(str(tiny_llama_dir), spec_cfg, [[20, 21, 22]], 4, DraftLength(), 1, 0, "fp32")
    assert result["peer_assisted"]["draft"] == str(tiny_llama_dir)
    assert type(seen["assistant"]).__name__ == "LlamaForCausalLM"
    assert not any("Quant" in type(m).__name__ for m in seen["assistant"].modules())  # the float model
