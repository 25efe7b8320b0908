"""Speculative decoding (toolkit/spec): greedy identity with the target alone for every draft, batch and cache kind;
stop tokens, stop strings and the token budget; rollback; clear errors. The accept/resample rule is in
test_spec_verify.py, the drafts and the draft-length policy in test_spec_drafts.py, transformers' assisted-generation
peers in test_spec_peers.py. Those files import the helpers defined here (the prompts, the token ids of a result);
the fixtures they share (one torch thread, the tiny llama and gemma3 pair) are in tests/conftest.py."""


import pytest
import torch

from toolkit.engine.generate import generate
from toolkit.errors import InputError
from toolkit.kv import KVSpec
from toolkit.spec.build import build_draft
from toolkit.spec.decode import DraftLength, speculative_generate
from toolkit.spec.draft_head import quantize_draft_head
from toolkit.spec.drafts import LookupDraft, ModelDraft
from toolkit.spec.ragged import RaggedBatch
from toolkit.spec.self_draft import build_self_draft

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _prompts(n: int) -> list[str]:
    """Varied prompts from offline text: some repeat themselves (lookup finds matches), some do not."""
    import pydoc_data.topics

    texts = [t for t in pydoc_data.topics.topics.values() if len(t) > 400]
    out = []
    for i in range(n):
        text = texts[(7 * i) % len(texts)]
        start = (37 * i) % 200
        chunk = text[start:start + 60 + 13 * (i % 5)]
        out.append(chunk + " " + chunk[:25] if i % 2 else chunk)
    return out


def _drafts(model, tokenizer, other):
    return {
        "lookup": lambda: LookupDraft(3, 1),
        "lookup-scaled": lambda: LookupDraft(3, 1, scale_by_match=True),
        "lookup-agree": lambda: LookupDraft(3, 1, scale_by_match=True, agree_tokens=4, doubt_k=2),  # the default
        "self-int4-1layer": lambda: ModelDraft(build_self_draft(model, layers=1, bits=4, group_size=32)),
        "self-all-layers": lambda: ModelDraft(build_self_draft(model, bits=None)),
        "self-int4-head": lambda: ModelDraft(_with_int4_head(build_self_draft(model, layers=1, bits=4, group_size=32))),
        # the spec=self defaults: the target's keys and values (one sequence; a batch keeps its own), int8 head
        "self-shared-kv": lambda: build_draft({"kind": "self", "bits": 4, "group_size": 32, "share_kv": True,
                                               "act_bits": 8, "head_bits": 8, "head_group_size": 32}, model, tokenizer),
        # spec.head_vocab: the head over the 64 most frequent tokens of the offline text + the context's own
        "self-subset-head": lambda: build_draft({"kind": "self", "bits": 4, "group_size": 32, "share_kv": True,
                                                 "act_bits": 8, "head_bits": 8, "head_group_size": 32,
                                                 "head_vocab": 64}, model, tokenizer),
        "other-model": lambda: ModelDraft(other, target_tokenizer=tokenizer, draft_tokenizer=tokenizer,
                                          target_vocab=model.get_output_embeddings().weight.shape[0]),
    }


def _with_int4_head(draft):
    quantize_draft_head(draft, 4, 32)
    return draft


def _ids(result):
    return [s.token_ids for s in result.sequences]


@pytest.mark.parametrize("draft_name", ["lookup", "lookup-scaled", "self-int4-1layer", "self-all-layers", "other-model",
                                        "self-int4-head", "self-shared-kv", "self-subset-head"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_output_is_the_target_alone_one_sequence_at_a_time(llama_and_gemma, arch, draft_name):
    llama, gemma, tok = llama_and_gemma
    model, other = (llama, gemma) if arch == "llama" else (gemma, llama)
    prompts = _prompts(8)
    reference = _ids(generate(model, tok, prompts, 16, stop_tokens=set()))
    make = _drafts(model, tok, other)[draft_name]
    for i, prompt in enumerate(prompts):
        length = DraftLength(k=1 + i % 5, adaptive=i % 2 == 1, k_min=1, k_max=6)
        out = speculative_generate(model, tok, [prompt], 16, make(), length, stop_tokens=set())
        assert out.sequences[0].token_ids == reference[i], (draft_name, i)


@pytest.mark.parametrize("draft_name", ["lookup", "lookup-scaled", "self-int4-1layer", "self-all-layers", "other-model",
                                        "self-shared-kv", "self-subset-head"])
def test_a_batch_keeps_different_lengths_per_row_and_equals_each_row_alone(llama_and_gemma, draft_name):
    llama, gemma, tok = llama_and_gemma
    prompts = _prompts(6)
    reference = _ids(generate(llama, tok, prompts, 16, stop_tokens=set()))
    alone = [speculative_generate(llama, tok, [p], 16, _drafts(llama, tok, gemma)[draft_name](), DraftLength(4),
                                  stop_tokens=set()).sequences[0].token_ids for p in prompts]
    batched = speculative_generate(llama, tok, prompts, 16, _drafts(llama, tok, gemma)[draft_name](),
                                   DraftLength(4), stop_tokens=set())
    assert _ids(batched) == alone == reference
    if draft_name in ("self-int4-1layer", "other-model"):  # drafts that partly agree with this random target
        assert len(batched.stats.histogram) > 1  # rows really did keep different numbers of tokens


def test_quantized_kv_caches_roll_back_exactly(llama_and_gemma):
    """With every KV cache kind the engine offers, speculation reproduces the engine on that same cache."""
    from toolkit.kv import KINDS

    llama, _, tok = llama_and_gemma
    prompts = _prompts(4)
    for kind in KINDS:
        reference = _ids(generate(llama, tok, prompts, 16, stop_tokens=set(), kv=KVSpec(kind)))
        for make in (LookupDraft, lambda: LookupDraft(scale_by_match=True),
                     lambda kind=kind: ModelDraft(build_self_draft(llama, bits=None), kv=KVSpec(kind)),
                     lambda: build_draft({"kind": "self", "bits": 4, "group_size": 32, "share_kv": True}, llama, tok)):
            alone = [speculative_generate(llama, tok, [p], 16, make(), DraftLength(3), stop_tokens=set(),
                                          kv=KVSpec(kind)).sequences[0].token_ids for p in prompts]
            assert alone == reference, kind


@pytest.mark.parametrize("name,forward", [("llama", "transformers"), ("llama", "lean"), ("gemma3", "transformers")])
def test_greedy_identity_holds_when_a_flush_falls_inside_a_verify_pass(tiny_llama_dir, tiny_gemma3_dir, name,
                                                                       forward):
    """A quantized cache reads a token back quantized from the step after it leaves the full-precision window. With
    a window of 8 and groups of 8-16 a flush falls inside most verify passes: each row must still read the cache as
    one-token decoding would at its position (docs/speculative.md, "Speculative decoding on a quantized cache"): the lean
    forward updates and attends piece by piece inside each layer, other forwards run the pieces as passes."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.engine.lean_forward import install

    path = tiny_llama_dir if name == "llama" else tiny_gemma3_dir
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    assert install(model, forward) == forward
    prompts = _prompts(4)
    for bits, group in [(8, 8), (4, 16), (2, 16)]:
        kind = OmegaConf.create({"kind": f"int{bits}", "bits": bits, "group_size": group, "residual": 8})
        # one at a time: in a left-padded batch the padding would move where each sequence's flushes fall. 32 new
        # tokens: 2-4 flushes a sequence, most of them inside a verify pass of 5 rows
        kv = KVSpec.from_node(kind)
        reference = [generate(model, tok, [p], 32, stop_tokens=set(), kv=kv).sequences[0].token_ids
                     for p in prompts]
        for make in (LookupDraft, lambda: build_draft({"kind": "self", "bits": 4, "group_size": 32,
                                                       "share_kv": True}, model, tok)):
            alone = [speculative_generate(model, tok, [p], 32, make(), DraftLength(4), stop_tokens=set(),
                                          kv=kv).sequences[0].token_ids for p in prompts]
            assert alone == reference, (bits, group)


def test_stop_tokens_and_the_token_budget_are_exact(llama_and_gemma):
    llama, _, tok = llama_and_gemma
    prompts = _prompts(6)
    free = _ids(generate(llama, tok, prompts, 30, stop_tokens=set()))
    stop = {free[0][7], free[3][12]}  # tokens that occur mid-generation
    reference = generate(llama, tok, prompts, 30, stop_tokens=stop)
    for draft in (LookupDraft(), ModelDraft(build_self_draft(llama, bits=None))):
        out = speculative_generate(llama, tok, prompts, 30, draft, DraftLength(6), stop_tokens=stop)
        assert _ids(out) == _ids(reference)
        assert [s.finish_reason for s in out.sequences] == [s.finish_reason for s in reference.sequences]
        assert all(len(s.token_ids) <= 30 and not stop & set(s.token_ids) for s in out.sequences)
    for n in (1, 2, 5):  # budgets below k: the self-draft would keep everything, so only the budget stops it
        out = speculative_generate(llama, tok, prompts[:2], n, ModelDraft(build_self_draft(llama, bits=None)),
                                   DraftLength(8), stop_tokens=set())
        assert [len(s.token_ids) for s in out.sequences] == [n, n]


def test_stop_strings_cut_the_text_as_the_engine_does(llama_and_gemma):
    llama, _, tok = llama_and_gemma
    prompt = _prompts(2)[1]
    free = generate(llama, tok, [prompt], 30, stop_tokens=set()).sequences[0].text
    stop = free[10:13]
    reference = generate(llama, tok, [prompt], 30, stop_tokens=set(), stop_strings=[stop]).sequences[0]
    out = speculative_generate(llama, tok, [prompt], 30, LookupDraft(), DraftLength(5), stop_tokens=set(),
                               stop_strings=[stop]).sequences[0]
    assert (out.text, out.finish_reason) == (reference.text, reference.finish_reason) and stop not in out.text


def test_rollback_leaves_the_cache_as_if_the_rejected_tokens_never_ran(llama_and_gemma):
    from toolkit.kv import make_kv_cache

    llama, _, tok = llama_and_gemma
    a, b, c = [5, 9, 31, 77, 120], [33, 44, 55, 66], [200, 201, 202]

    def batch():
        return RaggedBatch(llama, make_kv_cache(llama, 64), 2, tok.pad_token_id)

    rolled = batch()
    rolled.mark()
    rolled.feed([a + b, a[:3]])
    rolled.keep([len(a), 3])  # row 0 drops b; row 1 keeps all it was given
    rolled.mark()
    got = rolled.feed([c, c])
    fresh = batch()
    fresh.mark()
    fresh.feed([a, a[:3]])
    want = fresh.feed([c, c])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert rolled.counts.tolist() == [len(a) + len(c), 3 + len(c)]


def test_a_draft_with_another_tokenizer_is_a_clear_error(llama_and_gemma, tiny_tokenizer):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    _, gemma, tok = llama_and_gemma
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(["a different corpus entirely " * 50], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>"], show_progress=False))
    other_tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>", pad_token="<pad>")
    with pytest.raises(InputError, match="tokenizer does not match") as err:
        ModelDraft(gemma, target_tokenizer=tok, draft_tokenizer=other_tok)
    assert "same tokenizer" in str(err.value)
    ModelDraft(gemma, target_tokenizer=tok, draft_tokenizer=tiny_tokenizer)  # equal vocabularies pass
