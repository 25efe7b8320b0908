"""KL(reference || model) in nats per token and top-1 agreement on the perplexity windows (perplexities of both come with it).

An `evaluate` module, loadable offline by path: evaluate.load("eval/kl_divergence").compute(predictions=texts,
model="smollm2-135m"). The maths lives in toolkit.evaluation (task "kl")."""

import datasets
import evaluate

from toolkit.evaluation.module import DESCRIPTION, compute


class KlDivergence(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="""KL(reference || model) in nats per token and top-1 agreement on the perplexity windows (perplexities of both come with it).""",
            citation="",
            inputs_description=DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string")}),
        )

    def _compute(self, predictions, model, **kwargs):
        return compute("kl", predictions, model, **kwargs)
