"""HellaSwag-style next-text choice (4 endings of equal word count) built deterministically from the given texts: accuracy by summed and by per-character log-probability, for the model and its reference.

An `evaluate` module, loadable offline by path: evaluate.load("eval/multiple_choice").compute(predictions=texts,
model="smollm2-135m"). The maths lives in toolkit.evaluation (task "mc")."""

import datasets
import evaluate

from toolkit.evaluation.module import DESCRIPTION, compute


class MultipleChoice(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="""HellaSwag-style next-text choice (4 endings of equal word count) built deterministically from the given texts: accuracy by summed and by per-character log-probability, for the model and its reference.""",
            citation="",
            inputs_description=DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string")}),
        )

    def _compute(self, predictions, model, **kwargs):
        return compute("mc", predictions, model, **kwargs)
