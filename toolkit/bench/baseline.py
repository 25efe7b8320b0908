"""transformers' own `generate()`, timed token by token through its streamer hook, as the baseline to beat."""

import torch
from transformers.generation.streamers import BaseStreamer

from toolkit.errors import InputError
from toolkit.quant.checkpoint import is_quantized_checkpoint, read_manifest
from toolkit.quant.formats import export_source, is_quantized_model
from toolkit.timing import GenerationTiming, Stopwatch


class _TimingStreamer(BaseStreamer):
    """generate() calls put() once with the prompt, then once per new token (batch of 1)."""

    def __init__(self, watch: Stopwatch):
        self.watch = watch
        self.seen_prompt = False

    def put(self, value):
        if self.seen_prompt:
            self.watch.mark()
        self.seen_prompt = True

    def end(self):
        pass


@torch.inference_mode()
def hf_generate_timed(model, input_ids: list[int], new_tokens: int, **generate_kwargs) -> tuple[list[int],
                                                                                                  GenerationTiming]:
    """Greedy generate() of exactly `new_tokens` tokens (end-of-sequence ignored, as in our bench runs).
    `generate_kwargs`: e.g. prompt_lookup_num_tokens=k for transformers' assisted generation, whose streamer
    receives accepted tokens in bursts, so its marks are chunks, not tokens (use the total, not the ITLs)."""
    ids = torch.tensor([input_ids], device=next(model.parameters()).device)
    watch = Stopwatch()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, streamer=_TimingStreamer(watch),
                         pad_token_id=model.generation_config.pad_token_id or 0, **generate_kwargs)
    return out[0, ids.shape[1]:].tolist(), watch.timing(len(input_ids), 1)


def float_source(model_name: str) -> str:
    """The float model transformers' baselines run for `model_name`: itself, or for a quantized checkpoint (ours
    or GPTQ/AWQ format) the float model it was quantized from."""

    if not is_quantized_model(model_name):
        return model_name
    source = read_manifest(model_name)["source"] if is_quantized_checkpoint(model_name) else export_source(model_name)
    if not source:
        raise InputError(f"{model_name} does not record the float model it was quantized from",
                         "pass baseline=none, or bench the float model separately")
    return source
