"""The kv group resolved once (toolkit/kv/config.py): every conf/kv YAML, a bare kind name and a composed node give
one KVSpec with the YAML's options; a bad one is a clear error naming the key; the library takes only KVSpecs."""

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from toolkit.cli.app import CONF_DIR
from toolkit.errors import InputError
from toolkit.kv import KINDS, KVSpec, make_kv_cache


@pytest.mark.parametrize("kind", KINDS)
def test_each_yaml_a_composed_node_and_a_bare_name_agree(kind):
    yaml = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "kv" / f"{kind}.yaml"))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        node = compose("generate", overrides=[f"kv={kind}"]).kv
    spec = KVSpec.from_node(node)
    assert spec.kind == kind and spec.quantized == (kind != "fp") and str(spec) == kind
    assert KVSpec.from_node(yaml) == spec and KVSpec.from_node(spec) is spec
    if kind == "fp":
        assert spec == KVSpec() == KVSpec.from_node(None) == KVSpec.from_node("fp") and spec.residual is None
        return
    assert spec.window == yaml["window"] == 0  # kv.window is the spec's (built for kv=fp only), the rest quant's
    assert {key: getattr(spec.quant, key) for key in yaml if key not in ("kind", "window")} == {
        k: v for k, v in yaml.items() if k not in ("kind", "window")}
    assert KVSpec.from_node(kind).quant.bits == yaml["bits"]


def test_bad_settings_name_the_key_and_the_fix():
    with pytest.raises(InputError, match="unknown KV cache kind 'int3'"):
        KVSpec.from_node("int3")
    with pytest.raises(InputError, match="kv=int8 with kv.bits=4") as err:
        KVSpec.from_node({"kind": "int8", "bits": 4})
    assert "kv=int4" in err.value.fix
    with pytest.raises(InputError, match="unknown kv option.*residuals"):
        KVSpec.from_node({"kind": "int4", "residuals": 8})
    with pytest.raises(InputError, match="kv.group_size"):
        KVSpec.from_node({"kind": "int4", "group_size": 24})
    with pytest.raises(InputError, match="kv.residual>=9"):
        KVSpec.from_node({"kind": "int4", "crop_shadow": False, "residual": 4}).with_rollback(9, "a test")


def test_the_library_takes_a_kvspec_not_a_node():
    with pytest.raises(TypeError, match="KVSpec.from_node"):
        make_kv_cache(None, 8, "int4")
