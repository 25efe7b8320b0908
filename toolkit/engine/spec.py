"""The `engine` config group (conf/engine/*.yaml) resolved once into a typed, validated object.

`EngineSpec.from_node` is called at the CLI boundary (and by `default_engine_config` for scripts); everything below
it (`configure_engine`, `load_engine_model`, `prepare_engine_model`, the benches, eval, serve, diagnose) takes the
EngineSpec and reads its attributes: no `.get("key", default)` on engine nodes anywhere else. The dataclass defaults
are those of conf/engine/default.yaml (tests/test_engine_spec.py checks that they agree: the YAML is the user's
source), so a partial dict built in code runs as the CLI would.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from toolkit.engine.lean_forward import FORWARDS
from toolkit.engine.precision import DTYPES, GEMMS, PREFILL_DTYPES
from toolkit.errors import InputError
from toolkit.settings import node_values, refuse_unknown

ENGINE_DOTS = ("fp32", "bf16", "int8")
"""engine.native_dot: the native stack's products. fp32 and bf16 apply to a float model's stack, int8 to an int4 or
int8 checkpoint's (docs/engine.md, "int8 activations")."""
LOWBIT_KERNELS = ("auto", "specquant", "torch")
WIDE_COPIES = (True, False, "auto")


@dataclass(frozen=True)
class EngineSpec:
    """Every key of conf/engine/default.yaml (see there for what each does), checked once."""
    device: str = "cpu"
    dtype: str = "auto"
    weight_dtype: str = "auto"
    wide_copy: bool | str = "auto"
    prefill_dtype: str = "fp32"
    gemm: str = "auto"
    native_dot: str = "fp32"
    forward: str = "auto"
    lowbit_kernel: str = "auto"
    threads: int | None = None
    compile: bool = False

    def __post_init__(self):
        dtypes = ("auto", *DTYPES)
        _choice("dtype", self.dtype, dtypes)
        _choice("weight_dtype", self.weight_dtype, dtypes)
        _choice("wide_copy", self.wide_copy, WIDE_COPIES, "true, false or auto")
        _choice("prefill_dtype", self.prefill_dtype, PREFILL_DTYPES)
        _choice("gemm", self.gemm, GEMMS)
        _choice("native_dot", self.native_dot, ENGINE_DOTS)
        _choice("forward", self.forward, FORWARDS)
        _choice("lowbit_kernel", self.lowbit_kernel, LOWBIT_KERNELS)
        if not isinstance(self.device, str) or not self.device:
            raise InputError(f"engine.device={self.device!r} is not a device name", "use engine.device=cpu")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise InputError(f"engine.threads must be >= 1, got {self.threads!r}", "use null for all cores")
        if not isinstance(self.compile, bool):
            raise InputError(f"engine.compile={self.compile!r} is not true or false", "use engine.compile=true|false")

    @classmethod
    def from_node(cls, node=None) -> EngineSpec:
        """From an engine node (hydra's DictConfig or a dict; keys it leaves out take default.yaml's values), None
        (the defaults) or an EngineSpec (returned as is)."""
        if isinstance(node, EngineSpec):
            return node
        if node is None:
            return cls()
        values = node_values(node)
        values.pop("_target_", None)
        refuse_unknown(values, (f.name for f in dataclasses.fields(cls)), "engine",
                       "see conf/engine/default.yaml for the keys engine.* takes")
        return cls(**values)

    def replace(self, **changes) -> EngineSpec:
        """A copy with `changes` (validated again)."""
        return dataclasses.replace(self, **changes)


def _choice(key: str, value, choices, spelled: str | None = None) -> None:
    """An InputError naming engine.`key`, its allowed values and the default, unless `value` is one of `choices`
    (a bool only where a bool is: True == 1 must not pass as a name)."""
    if any(c is value if isinstance(c, bool) or isinstance(value, bool) else c == value for c in choices):
        return
    default = {f.name: f.default for f in dataclasses.fields(EngineSpec)}[key]
    default = str(default).lower() if isinstance(default, bool) else default
    raise InputError(f"engine.{key}={value!r} is not one of {spelled or ', '.join(map(str, choices))}",
                     f"use engine.{key}={default} (the default) or one of those")
