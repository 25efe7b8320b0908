"""HellaSwag-style next-text choice (4 endings of equal word count) built deterministically from the given texts: accuracy by summed and by per-character log-probability, for the model and its reference.

An `evaluate` module, loadable offline by path: evaluate.load("eval/multiple_choice").compute(predictions=texts,
model="smollm2-135m"). The maths lives in toolkit.evaluation (task "mc")."""

import evaluate

from toolkit.evaluation.module import compute, metric_info


class MultipleChoice(evaluate.Metric):
    def _info(self):
        return metric_info(__doc__.split("\n\n")[0])

    def _compute(self, predictions, model, **kwargs):
        return compute("mc", predictions, model, **kwargs)
