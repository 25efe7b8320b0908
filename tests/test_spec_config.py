"""The spec group resolved once (toolkit/spec/config.py): what a user runs is the YAML's, for a composed node and a
bare kind name alike; an unknown or bad option is a clear error naming it."""

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from toolkit.cli.app import CONF_DIR
from toolkit.errors import InputError
from toolkit.kv import KVSpec
from toolkit.spec.config import KINDS, SpecConfig


@pytest.mark.parametrize("kind", KINDS)
def test_a_composed_node_and_a_bare_name_give_the_yamls_values(kind):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        node = compose("generate", overrides=[f"spec={kind}"]).spec
    yaml = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "spec" / f"{kind}.yaml"))
    if "kv" in yaml:  # the draft's cache is resolved once too: a KVSpec of the YAML's kind
        yaml["kv"] = KVSpec.from_node(yaml["kv"])
    for spec in (SpecConfig.of(node), SpecConfig.of(kind)):
        assert {key: getattr(spec, key) for key in yaml} == yaml
    assert SpecConfig.of(SpecConfig.of(kind)) == SpecConfig.of(kind)


def test_the_self_drafts_shipped_defaults_are_the_ones_that_run():
    spec = SpecConfig.of("self")
    assert spec.share_kv is True and spec.head_bits == 8 and spec.act_bits == 8  # conf/spec/self.yaml's


def test_an_unknown_or_bad_option_is_a_clear_error():
    with pytest.raises(InputError, match="unknown spec option.*shared_kv"):
        SpecConfig.of({"kind": "self", "shared_kv": True})
    with pytest.raises(InputError, match="unknown speculative decoding kind"):
        SpecConfig.of("medusa")
    with pytest.raises(InputError, match="k_min <= k_max"):
        SpecConfig.of({"kind": "lookup", "k_min": 5, "k_max": 2})
    assert SpecConfig.of(None).kind == "none"
