"""The real draft/target pair (Qwen2.5-Coder 0.5B and 1.5B): opt-in, since fetching converts GBs.
Run with SPECQUANT_BIG_MODELS=1 (the fetch happens on first use)."""

import pytest
import torch

from toolkit.engine import generate

pytestmark = pytest.mark.big_model


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_qwen_fp32_greedy_is_token_identical_to_generate(name):
    from toolkit.models import load_model

    loaded = load_model(name)
    prompts = ["def quicksort(items):\n    ", "# Read a CSV file and print the sum of the second column\nimport csv\n"]
    ours = generate(loaded.model, loaded.tokenizer, prompts, 24).sequences
    enc = loaded.tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        out = loaded.model.generate(**enc, max_new_tokens=24, do_sample=False)
    eos = loaded.tokenizer.eos_token_id
    for seq, row in zip(ours, out):
        ref = row[enc.input_ids.shape[1]:].tolist()
        assert seq.token_ids == (ref[:ref.index(eos)] if eos in ref else ref)


def test_draft_and_target_share_a_tokenizer():
    from toolkit.models import load_tokenizer

    draft, target = load_tokenizer("qwen2.5-coder-0.5b"), load_tokenizer("qwen2.5-coder-1.5b")
    assert draft.get_vocab() == target.get_vocab()
