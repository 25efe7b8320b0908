"""Other tools' quantizers side by side (benchmarks.quant_peers): the dump eval/peers/ scripts write becomes a
checkpoint that runs exactly as our own with the same codes would. The peers themselves (llm-compressor,
AutoRound) need their own venv and are not run here."""

import contextlib
import json
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.quant_peers import checkpoint_from_dump, main, read_dump
from toolkit.errors import InputError
from toolkit.model_state import peek
from toolkit.quant.checkpoint import (
    load_quantized,
    peer_record,
    read_manifest,
    save_quantized,
)
from toolkit.quant.model_quant import (
    QuantRecipe,
    quantize_model,
    swap_quantized_modules,
)
from toolkit.quant.qlinear import QuantLinear

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval" / "peers"))
from peer_dump import write_dump  # noqa: E402  (the peers' own writer: it imports nothing of ours)


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@contextlib.contextmanager
def _norm_changed(llama):
    """The final norm scaled while inside, as AWQ's fold changes norms: so a test sees the float rest carried."""
    with torch.no_grad():
        llama.model.norm.weight.mul_(1.5)
    try:
        yield llama
    finally:
        with torch.no_grad():
            llama.model.norm.weight.div_(1.5)


def _peer_dump(llama, path, qsd, **record):
    """A dump as a peer writes it, of codes we chose, with the final norm changed."""
    layers = {name: (qw.codes, qw.scale, qw.zero) for name, qw in qsd.weights.items()}
    with _norm_changed(llama):
        write_dump(str(path), llama, layers, {"tool": "a-peer", "method": "awq", "seconds": 1.0, "peak_rss_gib": 0.1,
                                              "bits": 4, "group_size": 32, "symmetric": False, **record})


def _logits(path, ids):
    model, qsd, _ = load_quantized(path)
    swap_quantized_modules(model, qsd, QuantLinear.from_quantized)
    with torch.no_grad():
        return model(ids).logits


def test_a_peer_dump_runs_exactly_as_our_checkpoint_of_the_same_codes(llama, tiny_llama_dir, tmp_path):
    qsd = quantize_model(llama, QuantRecipe(bits=4, group_size=32, symmetric=False), progress=False)
    dump = tmp_path / "peer.safetensors"
    _peer_dump(llama, dump, qsd)
    record, tensors = read_dump(dump)
    assert sorted(record["layers"]) == sorted(qsd.weights) and "float.model.norm.weight" in tensors
    assert "float.lm_head.weight" not in tensors  # tied to the embeddings: saved once

    with _norm_changed(llama):
        ours = save_quantized(tmp_path / "ours", llama, qsd, source=str(tiny_llama_dir))
    theirs = checkpoint_from_dump(dump, str(tiny_llama_dir), tmp_path / "theirs")
    ids = torch.randint(0, llama.config.vocab_size, (2, 24))
    assert torch.equal(_logits(ours, ids), _logits(theirs, ids))
    assert peer_record(theirs)["tool"] == "a-peer" and peer_record(ours) is None
    manifest = read_manifest(theirs)
    assert manifest["source"] == str(tiny_llama_dir) and manifest["recipe"]["method"] == "awq"


def test_the_engine_labels_a_peer_checkpoint_with_the_peers_method(llama, tiny_llama_dir, tmp_path):
    from toolkit.engine.setup import load_engine_model
    from toolkit.engine.spec import EngineSpec

    qsd = quantize_model(llama, QuantRecipe(bits=4, group_size=32, symmetric=False), progress=False)
    _peer_dump(llama, tmp_path / "d.safetensors", qsd, tool="auto-round", method="autoround")
    out = checkpoint_from_dump(tmp_path / "d.safetensors", str(tiny_llama_dir), tmp_path / "ck")
    assert read_manifest(out)["recipe"]["method"] == "rtn"  # our nearest
    loaded = load_engine_model(str(out), EngineSpec())
    assert peek(loaded.model).quant_label.startswith("auto-round autoround int4 g32")


def test_a_dump_that_does_not_fit_the_source_or_is_not_a_dump_is_refused(llama, tiny_llama_dir, tiny_gemma3_dir,
                                                                         tmp_path):
    from safetensors.torch import load_file, save_file

    qsd = quantize_model(llama, QuantRecipe(bits=4, group_size=32, symmetric=False), progress=False)
    dump = tmp_path / "d.safetensors"
    _peer_dump(llama, dump, qsd)
    with pytest.raises(InputError, match="does not fit"):
        checkpoint_from_dump(dump, str(tiny_gemma3_dir), tmp_path / "a")
    assert not (tmp_path / "a").exists()

    tensors = load_file(dump)
    del tensors["model.layers.0.mlp.up_proj.scale"]
    save_file(tensors, tmp_path / "cut.safetensors", metadata={"peer": json.dumps(read_dump(dump)[0])})
    with pytest.raises(InputError, match="up_proj.scale"):
        checkpoint_from_dump(tmp_path / "cut.safetensors", str(tiny_llama_dir), tmp_path / "b")
    save_file({"x": torch.zeros(1)}, tmp_path / "plain.safetensors")
    with pytest.raises(InputError, match="not a peer dump"):
        read_dump(tmp_path / "plain.safetensors")


def test_calibration_windows_are_the_ones_specquant_quantize_draws(tiny_llama_dir, tmp_path):
    from toolkit.models import load_tokenizer
    from toolkit.quant.calibration_data import calibration_batches

    out = tmp_path / "calib.pt"
    main(["calibration", "--model", str(tiny_llama_dir), "--out", str(out), "--n-samples", "4", "--seq-len", "32"])
    assert torch.equal(torch.load(out), calibration_batches(load_tokenizer(str(tiny_llama_dir)), "pydoc", 4, 32, 0))
