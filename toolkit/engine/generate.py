"""The generation loop: `prefill` (prompt -> first token) and `decode_step` (-> next token) over a preallocated
KV cache, in the manner of gpt-fast, but over any transformers causal-LM module.

Batches are left-padded so every sequence's next token sits in the last column; positions come from the attention
mask exactly as transformers' `generate()` derives them, so greedy output is token-identical to it.
"""

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from toolkit.engine.lean_forward import one_token_forward
from toolkit.engine.precision import bf16_prefill, exact_linears, overflowed
from toolkit.engine.sampling import SamplingParams, sample
from toolkit.errors import InputError
from toolkit.kv import make_kv_cache
from toolkit.kv.config import KVSpec
from toolkit.model_state import peek
from toolkit.timing import GenerationTiming, Stopwatch

# on_token(sequence_index, token_id, text_delta): called for every token of every running sequence, and once more
# per sequence at the end with token_id None to flush text held back (an incomplete UTF-8 character).
TokenCallback = Callable[[int, int | None, str], None]


@dataclass
class SequenceOutput:
    prompt_tokens: int
    token_ids: list[int]  # generated tokens: a stop token excluded, the tokens of a stop string included
    text: str  # decoded generated tokens, cut before a stop string
    finish_reason: str  # "stop" (stop token or string) or "length"


@dataclass
class GenerationResult:
    sequences: list[SequenceOutput]
    timing: GenerationTiming
    kv_bytes: int = 0  # bytes the KV cache held at the end (its `nbytes`: what the last decode step read)


def context_length(model) -> int:
    config = model.config.get_text_config(decoder=True)
    return int(getattr(config, "max_position_embeddings", 0) or 2**31)


@functools.cache
def takes_logits_to_keep(model_class) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def make_room(cache, rows: int) -> None:
    """Before a call adding `rows` tokens: a windowed cache drops what it no longer keeps (toolkit/kv/window.py);
    caches without `make_room` (a hierarchical cache's INT4 view) keep everything."""
    room = getattr(cache, "make_room", None)
    if room is not None:
        room(rows)


def _forward(model, input_ids, attention_mask, position_ids, cache, forward=None) -> torch.Tensor:
    forward = forward or model
    # prefill only needs the last position's logits: skip a [T, vocab] matmul
    kwargs = {"logits_to_keep": 1} if takes_logits_to_keep(type(model)) else {}
    make_room(cache, input_ids.shape[1])
    start = cache.length

    def run():
        return forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       cache=cache, use_cache=True, **kwargs).logits[:, -1]

    logits = run()
    if overflowed(model, logits):
        cache.crop(start)  # the overflowed step wrote garbage keys/values: drop them and redo it exactly
        with exact_linears():
            logits = run()
    return logits


@torch.inference_mode()
def paged_forward(model, cache, seqs, new_tokens: list[list[int]], keep: int = 1) -> torch.Tensor:
    """One model call over a paged KV cache (toolkit.kv.paged): `new_tokens` (the same number per sequence) added to
    `seqs`; the logits of each one's last position [rows, vocab], or of its last `keep` [rows, keep, vocab].
    Raises OutOfBlocks, before running anything, if the pool cannot hold the tokens. An fp16 overflow reruns the
    same binding in exact arithmetic: nothing is committed before `commit()`, so the rerun overwrites the same
    slots."""
    positions, mask = cache.bind(seqs, new_tokens)
    ids = torch.tensor(new_tokens, device=cache.device)
    kwargs = {"logits_to_keep": keep} if takes_logits_to_keep(type(model)) else {}

    def run():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                       **kwargs).logits
        return logits[:, -1] if keep == 1 else logits[:, -keep:]

    logits = run()
    if overflowed(model, logits):
        with exact_linears():
            logits = run()
    cache.commit()
    return logits


@torch.inference_mode()
def prefill(model, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
    """Run the prompts [batch, T] through the model, filling `cache`; return the last position's logits. Its
    products run in bf16 where the model was prepared for it (`engine.prefill_dtype`, engine/precision.py). A cache
    that takes fewer rows a call (a windowed one: `call_rows`) gets the prompts in pieces of that many."""
    step = getattr(cache, "call_rows", None) or input_ids.shape[1]
    with bf16_prefill():
        for start in range(0, input_ids.shape[1], step):
            end = start + step
            mask = attention_mask[:, :end] if attention_mask is not None else None
            positions = position_ids[:, start:end] if position_ids is not None else None
            logits = _forward(model, input_ids[:, start:end], mask, positions, cache)
    return logits


@torch.inference_mode()
def decode_step(model, tokens, attention_mask, position_ids, cache) -> torch.Tensor:
    """Run one new token per sequence [batch, 1] against the cache; return its logits [batch, vocab].
    Uses the compiled forward that `engine.setup.compile_decode` attached, if any. One sequence on the native stack
    takes the lean forward's one-token path (`LeanForward.one_token`: the same logits, without the call's tensors and
    module plumbing around the stack; no overflow check, as the stack sums in fp32)."""
    compiled = peek(model).decode_forward
    lean = one_token_forward(model) if compiled is None and attention_mask is None and tokens.shape[0] == 1 else None
    if lean is not None:
        make_room(cache, 1)
        logits = lean.one_token(int(tokens[0, 0]), int(position_ids[0, -1]), cache)
        if logits is not None:
            return logits[:, -1]
    return _forward(model, tokens, attention_mask, position_ids, cache, compiled)


def encode_prompts(tokenizer, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts:
        raise InputError("no prompts given", "pass at least one prompt")
    encoded = []
    for i, prompt in enumerate(prompts):
        ids = list(prompt) if not isinstance(prompt, str) else tokenizer(prompt).input_ids
        if not ids or (isinstance(prompt, str) and not prompt.strip()):
            raise InputError(f"prompt {i} is empty", "give a prompt with some text in it")
        encoded.append([int(t) for t in ids])
    return encoded


def left_pad(encoded: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, T] ids and attention mask, padded on the left to the longest prompt."""
    width = max(len(ids) for ids in encoded)
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, ids in enumerate(encoded):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        mask[row, width - len(ids):] = 1
    return input_ids, mask


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids as transformers' generate() makes them: count of real tokens so far, pads at 1."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def stop_token_ids(model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return ids


class Detokenizer:
    """Incremental text for one sequence. Emits only text that can no longer change: never half a UTF-8
    character, and never the last len(longest stop string) - 1 characters, which might begin a stop string.
    `text` is cut before the first stop string, and `stopped` says one was found."""

    def __init__(self, tokenizer, stop_strings: Sequence[str]):
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.holdback = max((len(s) for s in self.stop_strings), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def push(self, token_ids: list[int], final: bool = False) -> str:
        full = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        cuts = [full.find(s) for s in self.stop_strings if s in full]
        if cuts:
            full, self.stopped, final = full[:min(cuts)], True, True
        self.text = full
        if not final and full.endswith("\ufffd"):
            return ""
        limit = len(full) if final else len(full) - self.holdback
        delta = full[self.emitted:limit]
        self.emitted = max(self.emitted, limit)
        return delta


def validate_request(model, prompt_lengths: list[int], new_tokens: int, kv: KVSpec | None = None) -> None:
    if new_tokens <= 0:
        raise InputError(f"new_tokens must be > 0, got {new_tokens}", "ask for at least one new token")
    if kv is not None and kv.window:
        if len(set(prompt_lengths)) > 1:
            raise InputError(f"kv.window={kv.window} with prompts of different lengths: a window holds one "
                             "unpadded batch", "generate the prompts one at a time, or drop kv.window")
        return  # a window holds any length: the sinks and the last tokens (toolkit/kv/window.py)
    limit = context_length(model)
    longest = max(prompt_lengths)
    if longest + new_tokens > limit:
        raise InputError(
            f"prompt of {longest} tokens + {new_tokens} new tokens exceeds the model's context of {limit} tokens",
            f"shorten the prompt to at most {limit - new_tokens} tokens or lower new_tokens")


def generate(model, tokenizer, prompts, new_tokens: int, sampling: SamplingParams = SamplingParams(),
             stop_strings: Sequence[str] = (), stop_tokens: set[int] | None = None,
             on_token: TokenCallback | None = None, kv: KVSpec | None = None) -> GenerationResult:
    """Generate up to `new_tokens` tokens for each prompt (text or token ids), timing prefill and every decode step.
    `kv`: the KV cache (a KVSpec, `KVSpec.from_node` of the kv group; None for full precision; see toolkit.kv)."""

    encoded = encode_prompts(tokenizer, prompts)
    validate_request(model, [len(ids) for ids in encoded], new_tokens, kv)
    stop_tokens = stop_token_ids(model, tokenizer) if stop_tokens is None else set(stop_tokens)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(stop_tokens), 0)
    device = next(model.parameters()).device
    input_ids, mask = (t.to(device) for t in left_pad(encoded, pad_id))
    batch, width = input_ids.shape
    padded = bool((mask == 0).any())
    cache = make_kv_cache(model, width + new_tokens, kv)
    generator = sampling.generator(device)
    detok = [Detokenizer(tokenizer, stop_strings) for _ in range(batch)] if (on_token or stop_strings) else None

    generated: list[list[int]] = [[] for _ in range(batch)]
    finish = [""] * batch
    watch = Stopwatch()
    positions = positions_from_mask(mask)
    # Without padding the mask is all ones: pass None, so attention can use its plain causal path.
    logits = prefill(model, input_ids, mask if padded else None, positions, cache)
    positions = positions[:, -1:]
    for step in range(new_tokens):
        if step:
            if padded:
                mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
            positions = positions + 1
            logits = decode_step(model, tokens[:, None], mask if padded else None, positions, cache)
        tokens = sample(logits, sampling, generator)
        watch.mark()
        for row, token in enumerate(tokens.tolist()):
            take_token(row, token, generated, finish, stop_tokens, detok, on_token)
        if all(finish):
            break
        if batch > 1:  # finished rows keep stepping (the batch moves together) on pad tokens, as generate() does
            tokens = tokens.masked_fill(torch.tensor([bool(f) for f in finish], device=device), pad_id)

    sequences = finish_sequences(tokenizer, encoded, generated, finish, detok, on_token)
    return GenerationResult(sequences, watch.timing(width, batch), kv_bytes=cache.nbytes)


def take_token(row: int, token: int, generated: list[list[int]], finish: list[str], stop_tokens: set[int],
               detok: list[Detokenizer] | None, on_token: TokenCallback | None) -> bool:
    """Append `token` to row `row`'s output (plain or speculative generation) unless the row has finished or the
    token is a stop token (which finishes it: "stop"); the row's detokenizer and `on_token` see it, and a stop string
    finishes the row too. Returns whether the token was taken."""
    if finish[row]:
        return False
    if token in stop_tokens:
        finish[row] = "stop"
        return False
    generated[row].append(token)
    if detok is not None:
        delta = detok[row].push(generated[row])
        if on_token:
            on_token(row, token, delta)
        if detok[row].stopped:
            finish[row] = "stop"
    return True


def finish_sequences(tokenizer, encoded: list[list[int]], generated: list[list[int]], finish: list[str],
                     detok: list[Detokenizer] | None, on_token: TokenCallback | None) -> list[SequenceOutput]:
    """The outputs of a finished generation (plain or speculative): each row's text, with any text the detokenizer
    held back flushed to `on_token`."""
    sequences = []
    for row in range(len(encoded)):
        if detok is None:
            text = tokenizer.decode(generated[row], skip_special_tokens=True)
        else:
            rest = detok[row].push(generated[row], final=True)
            if rest and on_token:
                on_token(row, None, rest)
            text = detok[row].text
        sequences.append(SequenceOutput(len(encoded[row]), generated[row], text, finish[row] or "length"))
    return sequences
