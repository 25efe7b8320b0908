"""Greedy generation agreement: the candidate and the reference continue the same prompts greedily through the
engine (the candidate with its KV cache), and we count where their tokens agree. Once two greedy runs diverge
they continue different texts, so `gen_prefix_match` (the mean length of the common prefix, as a share of the
tokens generated) is the cleaner figure; `gen_token_agreement` counts equal tokens position by position."""

from toolkit.engine.generate import generate
from toolkit.kv import KVSpec


def gen_prompts(tokenizer, texts: list[str], count: int, prompt_tokens: int) -> list[list[int]]:
    """`count` prompts of exactly `prompt_tokens` tokens (BOS first when there is one), evenly spaced over the
    joined text, so every prompt has the same length (no padding) and the set is deterministic."""
    ids = tokenizer("\n\n".join(texts), add_special_tokens=False).input_ids
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    body = prompt_tokens - len(bos)
    starts = range(0, max(1, len(ids) - body), max(1, (len(ids) - body) // max(count, 1)))
    return [bos + ids[s:s + body] for s in list(starts)[:count] if len(ids[s:s + body]) == body]


def score_generation(model, tokenizer, prompts: list[list[int]], new_tokens: int, reference=None,
                     kv: KVSpec | None = None, batch_size: int = 8) -> dict:
    def run(m, kv):
        out = []
        for start in range(0, len(prompts), batch_size):
            result = generate(m, tokenizer, prompts[start:start + batch_size], new_tokens, stop_tokens=set(), kv=kv)
            out.extend(seq.token_ids for seq in result.sequences)
        return out

    got = run(model, kv)
    ref = got if reference is None else run(reference, None)
    equal = prefix = total = 0
    for a, b in zip(got, ref):
        equal += sum(x == y for x, y in zip(a, b))
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix += common
        total += new_tokens
    return {"gen_token_agreement": equal / total, "gen_prefix_match": prefix / total}


def token_agreement(ours: list[list[int]], reference: list[list[int]]) -> float:
    """Share of generated positions where both hold the same token, position by position over the longer of each
    pair (a missing token counts as different); nan when there are none."""
    same = total = 0
    for a, b in zip(ours, reference):
        total += max(len(a), len(b))
        same += sum(x == y for x, y in zip(a, b))
    return same / total if total else float("nan")
