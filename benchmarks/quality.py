"""A quick quality check of quantized checkpoints against their float source, until the evaluation suite lands:
perplexity, KL(fp32 || quantized) and top-1 agreement on windows of held-out text (pydoc's evaluation split).

    python -m benchmarks.quality CHECKPOINT [CHECKPOINT ...] [--windows 4] [--window-tokens 512] [--exact-prefill]

--exact-prefill scores int8 per-channel checkpoints through the exact product (dequantize + fp32) instead of the
default int8 x int8 prefill with activations quantized per call (docs/notes/2026-12-runtime-kernels-native-decoder.md, "int8 prefill"): the weights' own error,
without the activations'.

Protocol: the evaluation documents joined by blank lines, tokenised once, cut into consecutive non-overlapping
windows; every position after the first of each window is scored; no BOS is added (SmolLM2 uses none)."""

import argparse
import contextlib

import torch


def window_ids(tokenizer, windows: int, window_tokens: int) -> torch.Tensor:
    from toolkit.data import load_text

    text = "\n\n".join(load_text("pydoc", "evaluation")["text"])
    ids = tokenizer(text, add_special_tokens=False).input_ids[:windows * window_tokens]
    if len(ids) < windows * window_tokens:
        raise SystemExit(f"only {len(ids)} evaluation tokens: ask for fewer windows")
    return torch.tensor(ids).view(windows, window_tokens)


@torch.inference_mode()
def compare(reference, candidate, ids: torch.Tensor) -> dict:
    ref = reference(ids).logits.float().log_softmax(-1)
    got = candidate(ids).logits.float().log_softmax(-1)
    target = ids[:, 1:, None]
    return {
        "perplexity": torch.exp(-got[:, :-1].gather(-1, target).mean()).item(),
        "reference_perplexity": torch.exp(-ref[:, :-1].gather(-1, target).mean()).item(),
        "kl": torch.nn.functional.kl_div(got, ref, log_target=True, reduction="none").sum(-1).mean().item(),
        "top1_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
    }


def main() -> None:
    from toolkit.engine.setup import load_quantized_model
    from toolkit.models import load_model
    from toolkit.quant.checkpoint import read_manifest
    from toolkit.quant.qlinear import exact_prefill

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--window-tokens", type=int, default=512)
    parser.add_argument("--exact-prefill", action="store_true",
                        help="int8 layers: dequantize + fp32 instead of int8 x int8 with quantized activations")
    args = parser.parse_args()
    sources = {read_manifest(c)["source"] for c in args.checkpoints}
    if len(sources) != 1:
        raise SystemExit(f"checkpoints come from different models: {sorted(sources)}")
    reference = load_model(sources.pop())
    ids = window_ids(reference.tokenizer, args.windows, args.window_tokens)
    print(f"{reference.name} fp32 vs checkpoints on {args.windows} x {args.window_tokens} tokens of pydoc evaluation")
    for path in args.checkpoints:
        with exact_prefill() if args.exact_prefill else contextlib.nullcontext():
            r = compare(reference.model, load_quantized_model(path).model, ids)
        print(f"{path}: perplexity {r['perplexity']:.3f} (fp32 {r['reference_perplexity']:.3f}), "
              f"KL {r['kl']:.4f}, top-1 agreement {r['top1_agreement']:.4f}")


if __name__ == "__main__":
    main()
