"""What the engine decided for a loaded model, kept beside the model in one object instead of on it.

The engine prepares a transformers model once (precision, forward, compiled decode step) and the layers above read
those decisions back: the KV caches need the activations' dtype, speculative decoding the compiled step, results
the checkpoint's label. `state_of(model)` holds them in an `EngineState` keyed weakly by the model, so nothing is
stuck onto the transformers module, a model the engine never prepared reads the defaults, and the state goes when
the model does. The fields are filled by toolkit.engine (docs/architecture.md, "Runtime state").
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class EngineState:
    precision: Any = None  # toolkit.engine.precision.Precision, set by prepare_model; None: the parameters' dtype
    forward: str | None = None  # the forward install_forward chose: "native", "lean" or "hf"
    decode_forward: Callable | None = None  # engine.compile: the torch.compile'd forward decode steps call
    quant_label: str | None = None  # a quantized checkpoint's method, bits and group, shown beside the dtype
    self_draft: dict | None = None  # a self-draft's layers / of / bits / group_size (spec.self_draft)


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def state_of(model) -> EngineState:
    """`model`'s state, created empty (the defaults) on first use."""
    state = _STATES.get(model)
    if state is None:
        state = _STATES[model] = EngineState()
    return state


def peek(model) -> EngineState:
    """`model`'s state without creating one: the defaults for a model the engine never touched."""
    return _STATES.get(model) or EngineState()


def inherit(copy, original, **changes) -> EngineState:
    """Give `copy` (a model made from `original`, e.g. a self-draft sharing its modules) `original`'s state with
    `changes`."""
    state = _STATES[copy] = dataclasses.replace(peek(original), **changes)
    return state
