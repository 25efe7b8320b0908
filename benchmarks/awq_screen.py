"""Screen AWQ variants in minutes, without a checkpoint and a full evaluation for each.

AWQ's checkpoint is round-to-nearest of AWQ's scaled, clipped float model. So each variant builds that float model
once (AWQ with ``scales_only``: scales searched and folded, clips applied, nothing rounded), rounds it, and measures
its KL to the float model on a few evaluation windows of each text. ``--breakdown`` rounds the first variant's
float model one Linear kind at a time, then one block at a time (the rest left unrounded): where the error sits.

    python -m benchmarks.awq_screen --recipe gemma3-270m/awq-w4g128 "" awq_gqa_v_o=true
    python -m benchmarks.awq_screen --recipe gemma3-270m/awq-w4g128 --breakdown awq_gqa_v_o=true

A variant is ``key=value[,key=value...]`` over the recipe's ``quantize`` keys ("" = the recipe as it is). The KL
is the evaluation's (`toolkit.evaluation`: BOS-first windows of the evaluation split, every token after the
first scored) on ``--windows`` windows per text, so it ranks variants; `specquant eval` gives the figures.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch


def parse_variant(variant: str) -> dict:
    """``"a=1,b=true"`` -> ``{"a": 1, "b": True}`` (values typed as YAML types them)."""
    import yaml

    out = {}
    for item in filter(None, (part.strip() for part in variant.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"a variant is key=value[,key=value...]; got {item!r} in {variant!r}")
        out[key.removeprefix("quantize.")] = yaml.safe_load(value)
    return out


def load_recipe(name: str) -> tuple[str, dict]:
    """``(model name, quantize keys)`` of a recipe name or file (as `specquant quantize recipe=` resolves it)."""
    from omegaconf import OmegaConf

    from toolkit.paths import recipe_path

    tree = OmegaConf.to_container(OmegaConf.load(recipe_path(name)))
    return tree["model"], dict(tree.get("quantize", {}))


class KLMeter:
    """Mean KL(reference || candidate) per scored token over fixed windows, the reference's logits kept (float32:
    Gemma's 262,144-token head makes that 0.5 GB a 512-token window, hence a few windows per text)."""

    def __init__(self, reference, windows: dict[str, torch.Tensor]):
        self.windows = windows
        with torch.no_grad():
            self.logits = {d: [reference(w[None]).logits[0].float() for w in ws] for d, ws in windows.items()}

    @torch.no_grad()
    def __call__(self, model) -> dict[str, float]:
        from toolkit.evaluation.metrics import kl_sum

        out = {}
        for data, windows in self.windows.items():
            total = count = 0
            for window, ref in zip(windows, self.logits[data]):
                total += kl_sum(ref[:-1], model(window[None]).logits[0].float()[:-1])
                count += ref.shape[0] - 1
            out[data] = total / count
        return out


def folded_float_model(model, tokenizer, recipe):
    """A copy of ``model`` as AWQ leaves it before rounding: scales folded, clips applied (``scales_only``)."""
    from toolkit.quant.calibrate import calibration_batches, fold_awq_scales

    folded = copy.deepcopy(model)
    batches = calibration_batches(tokenizer, recipe.dataset, recipe.n_samples, recipe.seq_len)
    fold_awq_scales(folded, recipe, batches, progress=False)
    return folded


class Rounder:
    """Rounds a chosen subset of a model's quantizable Linears to nearest (the rest back to their float weights)."""

    def __init__(self, model, recipe):
        from toolkit.quant.awq import fake_quantize
        from toolkit.quant.model_quant import quantizable_linears

        self.linears, _ = quantizable_linears(model, recipe)
        self.float = {n: m.weight.detach().clone() for n, m in self.linears.items()}
        self.rounded = {n: fake_quantize(w, recipe.config).to(w) for n, w in self.float.items()}

    def round(self, which=lambda name: True) -> None:
        for name, linear in self.linears.items():
            linear.weight.data.copy_(self.rounded[name] if which(name) else self.float[name])


def screen(model_name: str, base: dict, variants: list[str], data: list[str], windows: int = 4,
           breakdown: bool = False, report=print, window: int = 512) -> dict:
    """KL per text for each variant (and, with ``breakdown``, per Linear kind and block of the first)."""
    from toolkit.data import load_text
    from toolkit.evaluation.windows import make_windows
    from toolkit.models import load_model
    from toolkit.quant.calibrate import decoder_blocks
    from toolkit.quant.model_quant import QuantRecipe

    if base.get("method", "awq") != "awq":
        raise ValueError(f"the AWQ screen rounds AWQ's folded float model; this recipe is method={base['method']} "
                         f"(give an AWQ recipe, e.g. --recipe smollm2-135m/awq-w4g64)")
    # (a variant's experimental keys may come flat: awq_clip_grid=40 is experimental.awq_clip_grid=40)
    recipes = [(variant, QuantRecipe.from_dict({"method": "awq", **base, **parse_variant(variant)}, retired_ok=False))
               for variant in variants]
    for variant, recipe in recipes:  # refused before any model loads
        next_inputs = recipe.experimental.awq_next_inputs
        if recipe.awq_rounding != "rtn" or next_inputs != "float":
            # the screen rounds one fold made on the float blocks' outputs: it would measure another model
            raise ValueError(f"the AWQ screen measures AWQ with round-to-nearest codes and each block searched on "
                             f"the float block's outputs; variant {variant!r} sets awq_rounding="
                             f"{recipe.awq_rounding}, awq_next_inputs={next_inputs}: measure it with "
                             f"specquant quantize and specquant eval")
    loaded = load_model(model_name, dtype=torch.float32)
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    meter = KLMeter(model, {d: make_windows(tokenizer, load_text(d, "evaluation")["text"], window,
                                            max_windows=windows, data=d)[0] for d in data})
    results: dict = {"variants": {}}

    def line(label, kls):
        return f"{label:50s} " + "  ".join(f"{d} {kl:.4f}" for d, kl in kls.items())

    for i, (variant, recipe) in enumerate(recipes):
        start = time.perf_counter()
        folded = folded_float_model(model, tokenizer, recipe)
        rounder = Rounder(folded, recipe)
        rounder.round()
        results["variants"][variant] = kls = meter(folded)
        report(line(variant or "(the recipe)", kls) + f"  ({time.perf_counter() - start:.0f} s)")
        if breakdown and i == 0:
            results["breakdown"] = parts = {}
            rounder.round(lambda name: False)
            parts["nothing rounded"] = meter(folded)
            kinds = sorted({name.rsplit(".", 1)[-1] for name in rounder.linears})
            for kind in kinds:
                rounder.round(lambda name: name.endswith("." + kind))
                parts[f"only {kind}"] = meter(folded)
            prefix, blocks = decoder_blocks(folded)  # the driver's own idea of a block
            for block in range(len(blocks)):
                rounder.round(lambda name: name.startswith(f"{prefix}.{block}."))
                parts[f"only block {block}"] = meter(folded)
            for label, kls in parts.items():
                report("  " + line(label, kls))
        del folded, rounder
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.awq_screen", description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="*", default=[""], help='key=value[,key=value...]; "" = the recipe')
    parser.add_argument("--recipe", default="smollm2-135m/awq-w4g64", help="recipe name or file (its model too)")
    parser.add_argument("--model", default=None, help="another model than the recipe's")
    parser.add_argument("--data", default="pydoc,austen", help="texts, comma-separated")
    parser.add_argument("--windows", type=int, default=4, help="evaluation windows per text")
    parser.add_argument("--breakdown", action="store_true", help="round the first variant a kind / a block at a time")
    args = parser.parse_args(argv)
    model_name, base = load_recipe(args.recipe)
    return screen(args.model or model_name, base, args.variants or [""], args.data.split(","), args.windows,
                  args.breakdown)


if __name__ == "__main__":
    main()
