"""Shared fixtures: a tiny tokenizer trained in-test on offline text, and tiny random llama / gemma3 checkpoints
built from configs, so most tests need no download. Tests of the real SmolLM2 are marked `real_model`."""

import os

import pytest
import torch

from toolkit.cli.app import register_schemas

os.environ.setdefault("HF_HUB_OFFLINE", "1")
register_schemas()  # as the CLI does before composing a command with an engine: tests compose conf/ directly


def _train_tokenizer():
    import pydoc_data.topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = list(pydoc_data.topics.topics.values())
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", padding_side="left")


@pytest.fixture(scope="session", autouse=True)
def _throwaway_results_store(tmp_path_factory):
    """bench/eval runs under test append to a throwaway results store, never the user's."""
    patch = pytest.MonkeyPatch()
    patch.setenv("SPECQUANT_STORE", str(tmp_path_factory.mktemp("store") / "results.jsonl"))
    yield
    patch.undo()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return _train_tokenizer()


def _save(model, tokenizer, path):
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, tie_word_embeddings=True, bos_token_id=tiny_tokenizer.bos_token_id,
                         eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id)
    return _save(LlamaForCausalLM(config).eval(), tiny_tokenizer, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory, tiny_tokenizer):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128,
                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              sliding_window=8, layer_types=["sliding_attention", "sliding_attention",
                                                             "full_attention"],
                              max_position_embeddings=512, initializer_range=0.2,
                              bos_token_id=tiny_tokenizer.bos_token_id, eos_token_id=tiny_tokenizer.eos_token_id,
                              pad_token_id=tiny_tokenizer.pad_token_id)
    return _save(Gemma3ForCausalLM(config).eval(), tiny_tokenizer, tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="session", params=["llama", "gemma3"])
def tiny_model(request, tiny_llama_dir, tiny_gemma3_dir):
    """(model, tokenizer) in fp32 for each architecture the engine is tested on."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_llama_dir if request.param == "llama" else tiny_gemma3_dir
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and other jobs share the cores: spinning threads only slow all down.
    The speculation tests (tests/test_spec*.py) hold each module to one thread with `usefixtures`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llama_and_gemma(tiny_llama_dir, tiny_gemma3_dir):
    """The tiny llama and gemma3 in fp32 and the llama's tokenizer: the speculation tests' targets and drafts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llama = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    gemma = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32).eval()
    return llama, gemma, AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_tokenizer):
    """A tiny Qwen2: biases on q, k and v (which fused packs and the native decoder must carry), grouped-query
    attention. Tests copy it before changing it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, tie_word_embeddings=True, pad_token_id=tiny_tokenizer.pad_token_id)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)  # random init leaves them zero: make them count
    return model


def small_llama(tokenizer, heads: int = 4, kv_heads: int = 2, intermediate: int = 256, positions: int = 1024,
                seed: int = 3):
    """A 2-layer fp32 Llama of width 256 (head dim 256 / heads), tied embeddings: the native stack's shapes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=intermediate,
                         num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=positions, initializer_range=0.1, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_wide_llama(tiny_tokenizer):
    """A 2-layer Llama with head dim 64 and grouped-query attention (SmolLM2's attention shape: the native stack's
    register attention), fp32. Tests copy it before changing it."""
    return small_llama(tiny_tokenizer)


@pytest.fixture(scope="session")
def smollm2():
    """The real default model in fp32, from the specquant cache (CI fetches it with `specquant models fetch`)."""
    from toolkit.models import is_cached, load_model

    if not is_cached("smollm2-135m"):
        pytest.skip("SmolLM2-135M is not cached: run `specquant models fetch smollm2-135m`")
    return load_model("smollm2-135m", dtype=torch.float32)


def pytest_collection_modifyitems(config, items):
    """Big-model tests download and convert GBs: skipped, visibly, unless SPECQUANT_BIG_MODELS=1."""
    if os.environ.get("SPECQUANT_BIG_MODELS") == "1":
        return
    skip = pytest.mark.skip(reason="big model (GBs): set SPECQUANT_BIG_MODELS=1 to run")
    for item in items:
        if "big_model" in item.keywords:
            item.add_marker(skip)


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


@pytest.fixture(scope="session")
def chat_model_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny llama with a chat template (the session tokenizer has none): what the server tests serve."""
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-llama-chat")
    shutil.copytree(tiny_llama_dir, path, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def loaded(chat_model_dir):
    """The chat model loaded by the engine in fp32: what the server tests (tests/test_serve*.py) serve."""
    from toolkit.engine.setup import load_engine_model
    from toolkit.engine.spec import EngineSpec

    engine = EngineSpec(dtype="fp32", threads=None, compile=False)
    return load_engine_model(str(chat_model_dir), engine)
