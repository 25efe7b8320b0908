"""KL(reference || model) in nats per token and top-1 agreement on the perplexity windows (perplexities of both come with it).

An `evaluate` module, loadable offline by path: evaluate.load("eval/kl_divergence").compute(predictions=texts,
model="smollm2-135m"). The maths lives in toolkit.evaluation (task "kl")."""

import evaluate

from toolkit.evaluation.module import compute, metric_info


class KlDivergence(evaluate.Metric):
    def _info(self):
        return metric_info(__doc__.split("\n\n")[0])

    def _compute(self, predictions, model, **kwargs):
        return compute("kl", predictions, model, **kwargs)
