"""What the `evaluate` modules in eval/ call: load a model and its reference, run one task on the given texts.
The modules stay thin (features, docs); the maths lives here so the library never imports eval/."""

from toolkit.engine.spec import EngineSpec
from toolkit.evaluation.models import load_candidate, load_reference
from toolkit.evaluation.suite import Settings, run_tasks
from toolkit.kv import KVSpec

DESCRIPTION = """Inputs: `predictions`, the held-out documents (strings) the task is built from. Keyword arguments:
`model` (registry name, model directory or quantized checkpoint), `kv` (KV cache kind, default fp), `engine` (a
dict of engine settings, default the engine's auto precision), and any protocol setting of toolkit.evaluation.suite.
Settings (window, max_windows, chunk, items, max_context, gen_prompts, gen_prompt_tokens, gen_new_tokens).
The reference is the float model in fp32 with an fp KV cache (a checkpoint's float source; `reference`, a
registry name or directory, names another). The result holds the figures and the protocol they were measured
under."""


def compute(task: str, texts: list[str], model: str, kv: str | dict = "fp", engine: dict | None = None,
            data: str = "text", reference: str | None = None, **settings) -> dict:
    # a boundary like the CLI's: the caller's kv and engine settings are resolved (and checked) once, here
    kv, engine = KVSpec.from_node(kv), EngineSpec.from_node(engine)
    loaded = load_candidate(model, engine)
    reference, reference_name = load_reference(model, loaded, kv.kind, reference)
    out = run_tasks(loaded.model, loaded.tokenizer, list(texts), [task], Settings(**settings), reference, kv, data,
                    log=lambda line: None)
    return {**out["figures"], "protocol": out["protocol"][task], "reference": reference_name}


def metric_info(description: str):
    """The `evaluate.MetricInfo` every module in eval/ returns: texts in, the task's figures out."""
    import datasets
    import evaluate

    return evaluate.MetricInfo(description=description, citation="", inputs_description=DESCRIPTION,
                               features=datasets.Features({"predictions": datasets.Value("string")}))
