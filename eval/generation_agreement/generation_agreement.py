"""Greedy generation agreement with the reference model: common-prefix share and position-wise token agreement over prompts cut from the given texts.

An `evaluate` module, loadable offline by path: evaluate.load("eval/generation_agreement").compute(predictions=texts,
model="smollm2-135m"). The maths lives in toolkit.evaluation (task "gen")."""

import datasets
import evaluate

from toolkit.evaluation.module import DESCRIPTION, compute


class GenerationAgreement(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="""Greedy generation agreement with the reference model: common-prefix share and position-wise token agreement over prompts cut from the given texts.""",
            citation="",
            inputs_description=DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string")}),
        )

    def _compute(self, predictions, model, **kwargs):
        return compute("gen", predictions, model, **kwargs)
