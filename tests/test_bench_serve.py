"""The load benchmark end to end on a tiny model: the server in its own process, clients on one event loop here,
both phases served without errors, the batch really formed, the server's counters and RSS reported."""

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent  # where `python -m benchmarks.serve` runs


def test_load_benchmark_runs_the_server_in_its_own_process(tmp_path, tiny_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=tiny_tokenizer.bos_token_id, eos_token_id=tiny_tokenizer.eos_token_id,
                         pad_token_id=tiny_tokenizer.pad_token_id)
    model_dir = tmp_path / "tiny-1k"
    LlamaForCausalLM(config).eval().save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    out = tmp_path / "serve.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.serve", "--model", str(model_dir), "--clients", "3",
                          "--duration", "4", "--sequential-duration", "2", "--max-tokens", "6", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    for phase in ("sequential", "concurrent"):
        assert result[phase]["errors"] == 0, result[phase]["error_examples"]
        assert result[phase]["requests"] > 0 and result[phase]["completion_tokens"] > 0
    assert result["peak_batch"] > 1  # the three clients were batched together
    assert result["kv"]["peak_blocks_used"] > 0 and result["kv"]["preemptions"] == 0
    assert len(result["rss_samples"]) >= 3 and all(mb > 0 for _, mb in result["rss_samples"])
    assert result["throughput_ratio"] > 0
