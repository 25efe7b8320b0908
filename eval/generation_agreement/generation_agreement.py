"""Greedy generation agreement with the reference model: common-prefix share and position-wise token agreement over prompts cut from the given texts.

An `evaluate` module, loadable offline by path: evaluate.load("eval/generation_agreement").compute(predictions=texts,
model="smollm2-135m"). The maths lives in toolkit.evaluation (task "gen")."""

import evaluate

from toolkit.evaluation.module import compute, metric_info


class GenerationAgreement(evaluate.Metric):
    def _info(self):
        return metric_info(__doc__.split("\n\n")[0])

    def _compute(self, predictions, model, **kwargs):
        return compute("gen", predictions, model, **kwargs)
