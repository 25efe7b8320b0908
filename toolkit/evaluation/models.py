"""The candidate (as the engine runs it) and its reference (the float model in fp32, full-precision KV cache).

For a quantized checkpoint the reference is the float model it was quantized from (its manifest's `source`); for a
float model, the same weights in fp32. When the candidate already is that (float, fp32 weights and activations,
fp KV cache), it is its own reference (None) and every task runs once."""

import torch

from toolkit.engine.setup import load_engine_model
from toolkit.engine.spec import EngineSpec
from toolkit.errors import InputError
from toolkit.models import load_model
from toolkit.quant.checkpoint import is_quantized_checkpoint, read_manifest
from toolkit.quant.formats import export_source, is_foreign_quantized


def load_candidate(name: str, engine: EngineSpec | None = None):
    """`name` loaded as the engine runs it with `engine` (None: conf/engine/default.yaml's settings)."""

    loaded = load_engine_model(name, engine or EngineSpec())
    loaded.model.eval()
    return loaded


def load_reference(name: str, loaded, kind: str = "fp", reference: str | None = None):
    """(reference model, or None when the candidate is its own reference; a description of it).

    ``reference`` (a registry name or model directory) names the float model to compare against instead, e.g. for
    a checkpoint another tool made, which does not say what it was quantized from; its tokenizer must be the
    candidate's (the same vocabulary, token for token), else the KL would compare unrelated tokens."""

    if reference is not None:
        chosen = load_model(reference, dtype=torch.float32)
        _check_same_vocabulary(loaded, chosen, reference)
        return chosen.model.eval(), f"{chosen.name} fp32 (reference={reference})"
    if is_quantized_checkpoint(name):
        source = read_manifest(name)["source"]
        return load_model(source, dtype=torch.float32).model.eval(), f"{source} fp32 (the checkpoint's float source)"

    if is_foreign_quantized(name):  # a GPTQ/AWQ-format directory: its float source, if our export recorded one
        source = export_source(name)
        if source is None:

            raise InputError(f"{name} is a GPTQ/AWQ-format checkpoint that does not say which float model it came "
                             "from, so there is no reference to compare against",
                             "name the float model it came from with reference=NAME_OR_DIR, or export it with "
                             "specquant export (which records the source)")
        return load_model(source, dtype=torch.float32).model.eval(), f"{source} fp32 (the export's float source)"
    precision = loaded.precision
    if precision.compute == torch.float32 and precision.weights == torch.float32 and kind == "fp":
        return None, f"{loaded.name} fp32 itself (fp32 weights and activations, fp KV cache)"
    return load_model(name, dtype=torch.float32).model.eval(), f"{loaded.name} fp32 with the fp KV cache"


def _check_same_vocabulary(loaded, chosen, reference: str) -> None:

    if loaded.tokenizer.get_vocab() != chosen.tokenizer.get_vocab():
        raise InputError(f"reference={reference} has another tokenizer than {loaded.name} (their vocabularies "
                         "differ), so their next-token distributions cannot be compared",
                         "name the float model the candidate was quantized from, or leave reference unset")
