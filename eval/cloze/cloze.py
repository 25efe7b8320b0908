"""LAMBADA-style last-word cloze built deterministically from the given texts: accuracy (every target token greedy) and mean target log-probability, for the model and its reference.

An `evaluate` module, loadable offline by path: evaluate.load("eval/cloze").compute(predictions=texts,
model="smollm2-135m"). The maths lives in toolkit.evaluation (task "cloze")."""

import evaluate

from toolkit.evaluation.module import compute, metric_info


class Cloze(evaluate.Metric):
    def _info(self):
        return metric_info(__doc__.split("\n\n")[0])

    def _compute(self, predictions, model, **kwargs):
        return compute("cloze", predictions, model, **kwargs)
