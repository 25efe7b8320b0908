"""The engine group resolved once (toolkit/engine/spec.py): EngineSpec's defaults are conf/engine/default.yaml's (the
YAML is what a user reads and runs), a composed node resolves to the same object, and a bad value is a clear error
naming the key and the fix before any model loads."""

import dataclasses

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from toolkit.cli.app import CONF_DIR
from toolkit.engine.setup import DEFAULT_ENGINE_YAML, default_engine_config, prepare_engine_model
from toolkit.engine.spec import EngineSpec
from toolkit.errors import InputError


def test_the_dataclass_defaults_are_the_yamls():
    yaml = OmegaConf.to_container(OmegaConf.load(DEFAULT_ENGINE_YAML))
    assert yaml.pop("defaults") == ["schema", "_self_"]  # typed by EngineSpec through hydra's ConfigStore
    fields = {f.name: f.default for f in dataclasses.fields(EngineSpec)}
    assert fields == yaml  # every key, and no key the YAML lacks
    assert EngineSpec.from_node(yaml) == EngineSpec() == default_engine_config()


@pytest.mark.parametrize("choice", ["default", "fp32"])
def test_a_composed_node_resolves_to_its_yamls_values(choice):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        node = compose("generate", overrides=[f"engine={choice}", "engine.threads=2", "engine.native_dot=bf16"]).engine
    spec = EngineSpec.from_node(node)
    assert spec.threads == 2 and spec.native_dot == "bf16" and spec.dtype == ("fp32" if choice == "fp32" else "auto")
    assert EngineSpec.from_node(spec) is spec and spec.replace(threads=None).threads is None


@pytest.mark.parametrize("key,value,fix", [
    ("native_dot", "int4", "engine.native_dot=fp32"),
    ("forward", "fast", "engine.forward=auto"),
    ("dtype", "fp8", "engine.dtype=auto"),
    ("weight_dtype", "int4", "engine.weight_dtype=auto"),
    ("prefill_dtype", "fp16", "engine.prefill_dtype=fp32"),
    ("gemm", "mkl", "engine.gemm=auto"),
    ("lowbit_kernel", "cuda", "engine.lowbit_kernel=auto"),
    ("wide_copy", "sometimes", "engine.wide_copy=auto"),
    ("threads", 0, "null for all cores"),
])
def test_a_bad_value_names_the_key_and_the_fix(key, value, fix):
    with pytest.raises(InputError, match=f"engine.{key}") as err:
        EngineSpec.from_node({key: value})
    assert fix in err.value.fix


def test_an_unknown_key_is_refused_and_a_node_is_refused_below_the_cli():
    with pytest.raises(InputError, match="unknown engine option.*native_dots"):
        EngineSpec.from_node({"native_dots": "bf16"})
    with pytest.raises(TypeError, match="EngineSpec.from_node"):
        prepare_engine_model(None, OmegaConf.create({"device": "cpu"}))


@pytest.mark.parametrize("override,problem", [("engine.threads=abc", "threads"), ("engine.compile=maybe", "compile"),
                                              ("engine.fast=true", "fast")])
def test_hydra_checks_the_engine_nodes_types_while_composing(override, problem):
    """conf/engine/*.yaml extend EngineSpec's schema in hydra's ConfigStore (toolkit/cli/app.py): a value of the
    wrong type or a key EngineSpec lacks fails in composition, before from_node or a model load."""
    from hydra.errors import ConfigCompositionException

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        with pytest.raises(ConfigCompositionException, match=problem):
            compose("generate", overrides=[override])
        node = compose("generate", overrides=["engine=fp32"]).engine
    assert OmegaConf.get_type(node) is EngineSpec and EngineSpec.from_node(node).dtype == "fp32"
