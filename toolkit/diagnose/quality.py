"""The what-ifs' quality change: KL(baseline || option) and perplexity on a small held-out slice.

Weight options are scored against the baseline model; KV options run the baseline model fed `chunk` tokens at a time
through their cache, so later chunks attend to quantized keys and values (the window must be longer than the cache's
full-precision residual for any of it to be quantized). Greedy speculative decoding and the prefix cache (cached
keys/values are the ones the prompt would compute) are lossless by construction: their KL is 0, and the report shows
the measured token agreement with the baseline as the check. bf16 prompt passes score each window as a prompt pass
(`bf16_prefill`): the logits every position of a bf16 prompt would give, against the baseline's."""

import contextlib

from toolkit.data import load_text
from toolkit.engine.precision import bf16_prefill
from toolkit.evaluation.perplexity import score_windows
from toolkit.evaluation.windows import make_windows

LOSSLESS = {"spec": "greedy speculative decoding", "prefix": "prefix cache: reused keys/values are the prompt's own"}


def quality_slice(tokenizer, data: str, window: int, windows: int):

    texts = load_text(data)["text"]
    ids, _ = make_windows(tokenizer, list(texts), window=window, max_windows=windows, data=data)
    return ids


def quality_change(options, windows, chunk: int) -> dict[str, dict]:
    base = options[0]
    reference = score_windows(base.model, windows, kv=base.kv, chunk=chunk)
    out = {base.name: {"kl": 0.0, "ppl": reference["ppl"], "ppl_change": 0.0, "scored": "baseline"}}
    for option in options[1:]:
        lossless = LOSSLESS.get(option.knob)
        if lossless:
            out[option.name] = {"kl": 0.0, "ppl": reference["ppl"], "ppl_change": 0.0,
                                "scored": f"lossless ({lossless})"}
            continue
        with bf16_prefill() if option.knob == "prefill" else contextlib.nullcontext():
            figures = score_windows(option.model, windows, reference=base.model, kv=option.kv, chunk=chunk)
        out[option.name] = {"kl": figures["kl"], "ppl": figures["ppl"],
                            "ppl_change": figures["ppl"] / reference["ppl"] - 1, "scored": "measured"}
    return out
