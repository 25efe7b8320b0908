"""Perplexity of a model on non-overlapping token windows (BOS first, every position after the first scored), with the reference model's perplexity, KL and top-1 agreement on the same windows.

An `evaluate` module, loadable offline by path: evaluate.load("eval/perplexity").compute(predictions=texts,
model="smollm2-135m"). The maths lives in toolkit.evaluation (task "ppl")."""

import evaluate

from toolkit.evaluation.module import compute, metric_info


class Perplexity(evaluate.Metric):
    def _info(self):
        return metric_info(__doc__.split("\n\n")[0])

    def _compute(self, predictions, model, **kwargs):
        return compute("ppl", predictions, model, **kwargs)
