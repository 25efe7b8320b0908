"""The engine: greedy output token-identical to transformers' generate() (fp32), batches of different lengths,
seeded sampling, stop tokens and strings, streaming, timing fields, bad input, the KV cache's crop."""

import pytest
import torch

from toolkit.engine import ContiguousKVCache, SamplingParams, generate
from toolkit.engine.precision import Bf16StorageLinear, prepare_model
from toolkit.engine.sampling import probabilities
from toolkit.errors import InputError

PROMPTS = ["The syntax of a function definition is", "A class is", "Iterators", "for x in range(10):",
           "The with statement is used to wrap the execution of a block with methods defined by a context manager"]


def hf_greedy(model, tokenizer, prompts, new_tokens):
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return [row[enc.input_ids.shape[1]:].tolist() for row in out]


def cut_at_stop(tokens, stop):
    return tokens[:tokens.index(stop)] if stop in tokens else tokens


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_transformers_generate_one_prompt(tiny_model, prompt):
    model, tok = tiny_model
    ours = generate(model, tok, [prompt], 20).sequences[0]
    theirs = cut_at_stop(hf_greedy(model, tok, [prompt], 20)[0], tok.eos_token_id)
    assert ours.token_ids == theirs


def test_greedy_batch_of_different_lengths_matches_generate(tiny_model):
    model, tok = tiny_model
    lengths = {len(tok(p).input_ids) for p in PROMPTS}
    assert len(lengths) > 1
    ours = generate(model, tok, PROMPTS, 16)
    theirs = hf_greedy(model, tok, PROMPTS, 16)
    for seq, ref in zip(ours.sequences, theirs):
        assert seq.token_ids == cut_at_stop(ref, tok.eos_token_id)


def test_batch_rows_equal_single_runs(tiny_model):
    model, tok = tiny_model
    batch = generate(model, tok, PROMPTS[:3], 12).sequences
    for prompt, seq in zip(PROMPTS[:3], batch):
        assert generate(model, tok, [prompt], 12).sequences[0].token_ids == seq.token_ids


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_model):
    model, tok = tiny_model
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    a = generate(model, tok, PROMPTS[:2], 24, params, stop_tokens=set())
    b = generate(model, tok, PROMPTS[:2], 24, params, stop_tokens=set())
    c = generate(model, tok, PROMPTS[:2], 24, SamplingParams(1.0, 50, 0.9, seed=99), stop_tokens=set())
    assert [s.token_ids for s in a.sequences] == [s.token_ids for s in b.sequences]
    assert [s.token_ids for s in a.sequences] != [s.token_ids for s in c.sequences]


def test_timing_fields_are_consistent(tiny_model):
    model, tok = tiny_model
    result = generate(model, tok, [PROMPTS[0]], 10, stop_tokens=set())
    timing = result.timing
    assert len(result.sequences[0].token_ids) == 10
    assert timing.new_tokens == 10 and len(timing.itl_s) == 9
    assert timing.ttft_s > 0 and all(t > 0 for t in timing.itl_s)
    summary = timing.summary()
    assert set(summary["itl_ms"]) == {"p50", "p90", "p99"}
    assert summary["itl_ms"]["p50"] <= summary["itl_ms"]["p90"] <= summary["itl_ms"]["p99"]
    assert summary["decode_tokens_per_s"] == pytest.approx(9 / sum(timing.itl_s))


def test_stop_token_ends_the_sequence(tiny_model):
    model, tok = tiny_model
    free = generate(model, tok, [PROMPTS[1]], 12, stop_tokens=set()).sequences[0]
    stop = free.token_ids[4]
    first = free.token_ids.index(stop)
    seq = generate(model, tok, [PROMPTS[1]], 12, stop_tokens={stop}).sequences[0]
    assert seq.token_ids == free.token_ids[:first] and seq.finish_reason == "stop"


def test_stop_string_cuts_the_text(tiny_model):
    model, tok = tiny_model
    free = generate(model, tok, [PROMPTS[0]], 16, stop_tokens=set()).sequences[0]
    needle = free.text[len(free.text) // 2:len(free.text) // 2 + 2]
    assert needle.strip()
    seq = generate(model, tok, [PROMPTS[0]], 16, stop_strings=[needle], stop_tokens=set()).sequences[0]
    assert seq.finish_reason == "stop" and needle not in seq.text
    assert free.text.startswith(seq.text)


def test_streaming_callback_concatenates_to_the_text(tiny_model):
    model, tok = tiny_model
    pieces = {0: [], 1: []}
    result = generate(model, tok, PROMPTS[:2], 12, stop_tokens=set(),
                      on_token=lambda row, token, delta: pieces[row].append(delta))
    for row, seq in enumerate(result.sequences):
        assert "".join(pieces[row]) == seq.text


@pytest.mark.parametrize("prompts, new_tokens, message", [
    ([""], 4, "empty"), (["   "], 4, "empty"), ([], 4, "no prompts"),
    (["hello"], 0, "new_tokens"), (["hello"], -3, "new_tokens"),
    (["word " * 600], 4, "context"), (["hello"], 600, "context"),
])
def test_bad_requests_are_clear_errors(tiny_model, prompts, new_tokens, message):
    model, tok = tiny_model
    with pytest.raises(InputError, match=message) as err:
        generate(model, tok, prompts, new_tokens)
    assert err.value.fix


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
])
def test_bad_sampling_settings_are_clear_errors(kwargs, message):
    with pytest.raises(InputError, match=message):
        SamplingParams(**kwargs)


def test_probabilities_apply_top_k_and_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert probabilities(logits, SamplingParams())[0].tolist() == [1, 0, 0, 0, 0]
    topk = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))[0]
    assert (topk[2:] == 0).all() and topk[:2].sum() == pytest.approx(1)
    full = logits.softmax(-1)[0]
    # top_p just above the first token's mass keeps exactly two tokens
    topp = probabilities(logits, SamplingParams(temperature=1.0, top_p=float(full[0]) + 1e-3))[0]
    assert (topp > 0).sum() == 2
    assert topp[0] / topp[1] == pytest.approx(float(full[0] / full[1]))


def test_cache_crop_then_append_equals_building_the_shorter_cache(tiny_model):
    model, tok = tiny_model
    ids = torch.tensor([tok(PROMPTS[4]).input_ids])
    n = ids.shape[1]
    with torch.inference_mode():
        cache = ContiguousKVCache.for_model(model, n + 4)
        model(ids, cache=cache, use_cache=True)
        cache.crop(n - 3)
        assert cache.length == n - 3
        tail = model(ids[:, n - 3:], cache=cache, use_cache=True).logits
        fresh = model(ids, use_cache=False).logits[:, n - 3:]
    assert torch.allclose(tail, fresh, atol=1e-5)
    with pytest.raises(ValueError):
        cache.crop(n + 1)


def test_cache_nbytes_counts_the_filled_part(tiny_model):
    model, tok = tiny_model
    config = model.config.get_text_config(decoder=True)
    cache = ContiguousKVCache.for_model(model, 64)
    with torch.inference_mode():
        model(torch.tensor([tok(PROMPTS[0]).input_ids]), cache=cache, use_cache=True)
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    assert cache.nbytes == per_token * cache.length


def test_bf16_storage_linear_matches_fp32_math():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32).to(torch.bfloat16)
    layer.__class__ = Bf16StorageLinear
    ref = torch.nn.Linear(64, 32)
    ref.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    for rows in (1, 16):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        assert torch.allclose(layer(x).float(), ref(x.float()), atol=0.05, rtol=0.02)


def test_prepare_model_keeps_tied_weights_tied(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = prepare_model(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), torch.bfloat16)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert model.lm_head.weight.dtype == torch.bfloat16
