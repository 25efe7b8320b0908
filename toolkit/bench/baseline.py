"""transformers' own `generate()`, timed token by token through its streamer hook, as the baseline to beat."""

import torch
from transformers.generation.streamers import BaseStreamer

from toolkit.engine.timing import GenerationTiming, Stopwatch


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
def hf_generate_timed(model, input_ids: list[int], new_tokens: int) -> tuple[list[int], GenerationTiming]:
    """Greedy generate() of exactly `new_tokens` tokens (end-of-sequence ignored, as in our bench runs)."""
    ids = torch.tensor([input_ids], device=next(model.parameters()).device)
    watch = Stopwatch()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, streamer=_TimingStreamer(watch),
                         pad_token_id=model.generation_config.pad_token_id or 0)
    return out[0, ids.shape[1]:].tolist(), watch.timing(len(input_ids), 1)
