"""Prompt lookup's draft-length rules, replayed exactly on recorded greedy outputs (toolkit/spec/drafts.py).

    python -m benchmarks.lookup_replay [--model smollm2-135m] [--prompts code,grounded,open] [--n-prompts 8]
                                       [--new-tokens 128] [--native-dot fp32|bf16]

`--native-dot`: the engine's `engine.native_dot` for the replay's model (costs and outputs are the setting's own).

Why a replay: timing a lookup run end to end is noisy here (the same command differs by 5-8% between runs), while
the differences between length rules are a few percent. But greedy output does not depend on the rule (speculation
is token-identical to the target alone), and a lookup draft is a function of the context, so every round of any
rule can be reconstructed from the target's greedy output alone: what the rule proposes at a position, and how many
of those tokens the target keeps (the longest common prefix with what the target actually generated next).

What it costs comes from the machine, measured in the same run: the time of one target pass feeding r new tokens
onto a filled cache (r = 1 .. 17, median of several), relative to a one-token step. A rule's predicted decode
speedup over the target alone is then tokens generated / sum over its rounds of cost(1 + proposed). It leaves out
what the rules share (prefill, the loop's own few percent), so it predicts the "after the first token" figure of
`specquant bench spec=lookup`, a little high. An oracle row proposes exactly the tokens that will be kept: no rule
that reads only the context can beat it, so it bounds what tuning the length can buy.
"""

import statistics
import time
from dataclasses import dataclass

import torch

from benchmarks._cli import parser as script_parser
from toolkit.spec.drafts import LookupDraft

MAX_ROWS = 17  # a k=16 round: the pending token and 16 drafted ones


@dataclass(frozen=True)
class Rule:
    name: str
    draft: LookupDraft | None  # None: the oracle
    k: int


RULES = (
    Rule("always k=8 (scale_by_match=false)", LookupDraft(3, 1, scale_by_match=False), 8),
    Rule("k=8 by match length (the former default)", LookupDraft(3, 1, scale_by_match=True), 8),
    Rule("k=16 by match length", LookupDraft(3, 1, scale_by_match=True), 16),
    Rule("k=16 by match length and agreement (the default)",
         LookupDraft(3, 1, scale_by_match=True, agree_tokens=4, doubt_k=2), 16),
    Rule("oracle: exactly what will be kept", None, 16),
)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def replay(rule: Rule, prompt: list[int], output: list[int], cost) -> tuple[float, int]:
    """(summed cost in one-token steps, rounds) of generating `output` after `prompt` with `rule`, as the loop in
    toolkit/spec/decode.py runs it: the first token comes from the prefill; each round feeds the pending token and
    the draft (at most budget - 1 tokens), keeps the agreeing prefix and the target's own next token."""
    finder = rule.draft or LookupDraft(3, 1)
    pos, total, rounds = 1, 0.0, 0
    while pos < len(output):
        context = prompt + output[:pos]
        budget = len(output) - pos
        round_k = min(rule.k, budget - 1)
        if rule.draft is None:  # the oracle: as many of the continuation's tokens as the target will keep
            found = finder.match(context) if round_k > 0 else None
            proposal = context[found[0]:found[0] + round_k] if found else []
            proposal = proposal[:_common_prefix(proposal, output[pos:])]
        else:
            proposal = rule.draft.lookup(context, round_k) if round_k > 0 else []
        proposal = proposal[:max(budget - 1, 0)]
        kept = _common_prefix(proposal, output[pos:])
        total += cost(1 + len(proposal))
        rounds += 1
        pos += kept + 1
    return total, rounds


def measure_costs(model, rows=range(1, MAX_ROWS + 1), context: int = 128, passes: int = 9) -> dict[int, float]:
    """Median time of a pass feeding r new tokens onto a `context`-token cache, relative to r = 1 (interleaved over
    r, so every width sees the same machine noise)."""
    from toolkit.kv.contiguous import ContiguousKVCache

    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    cache = ContiguousKVCache.for_model(model, context + max(rows) + 1)
    times = {r: [] for r in rows}
    with torch.inference_mode():
        model(input_ids=torch.randint(4, vocab, (1, context), generator=generator), cache=cache, use_cache=True,
              logits_to_keep=1)
        for _ in range(passes):
            for r in rows:
                ids = torch.randint(4, vocab, (1, r), generator=generator)
                start = time.perf_counter()
                model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=r)
                times[r].append(time.perf_counter() - start)
                cache.crop(context)
    step = statistics.median(times[min(rows)])
    return {r: statistics.median(t) / step for r, t in times.items()}


def run(model_name: str, prompt_sets: list[str], n_prompts: int, new_tokens: int, native_dot: str = "fp32") -> dict:
    from toolkit.data import build_prompts
    from toolkit.engine.generate import generate
    from toolkit.engine.setup import default_engine_config, load_engine_model

    loaded = load_engine_model(model_name, default_engine_config(native_dot=native_dot))  # as the CLI runs it
    costs = measure_costs(loaded.model)
    results = {}
    for name in prompt_sets:
        texts = build_prompts(name, loaded.tokenizer, 128, n_prompts)
        prompts = [loaded.tokenizer(t.text).input_ids for t in texts]
        outputs = [generate(loaded.model, loaded.tokenizer, [p], new_tokens).sequences[0].token_ids
                   for p in prompts]
        for rule in RULES:
            speedups = []
            for prompt, output in zip(prompts, outputs):
                total, _ = replay(rule, prompt, output, costs.__getitem__)
                speedups.append((len(output) - 1) / total)  # the first token is the prefill's, as "after 1st token"
            results[(name, rule.name)] = {"mean": statistics.mean(speedups),
                                          "first_3": statistics.mean(speedups[:3])}
    return {"model": loaded.name, "n_prompts": n_prompts, "new_tokens": new_tokens, "costs": costs,
            "prompt_sets": prompt_sets, "results": results, "native_dot": native_dot, "dtype": loaded.precision.name}


def print_result(out: dict) -> None:
    costs = out["costs"]
    print(f"{out['model']} ({out['dtype']}): cost of a pass feeding r new tokens, in one-token "
          f"steps (median, same run):")
    print("  " + "  ".join(f"{r}: {c:.2f}" for r, c in costs.items()))
    print(f"predicted decode speedup over the target alone, mean over {out['n_prompts']} prompts "
          f"({out['new_tokens']} new tokens; in brackets the first 3, the prompts `specquant bench n_prompts=3` runs)")
    sets = out["prompt_sets"]
    print(f"{'rule':52s}" + "".join(f"{s:>18s}" for s in sets))
    for rule in RULES:
        cells = [out["results"][(s, rule.name)] for s in sets]
        print(f"{rule.name:52s}" + "".join(f"{c['mean']:10.2f}x ({c['first_3']:.2f})" for c in cells))


def main(argv=None) -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--prompts", default="code,grounded,open")
    parser.add_argument("--n-prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--native-dot", default="fp32", choices=["fp32", "bf16"],
                        help="engine.native_dot for the model (docs/notes/2026-12-runtime-kernels-native-decoder.md, \"bf16 products on the native stack\")")
    args = parser.parse_args(argv)
    print_result(run(args.model, args.prompts.split(","), args.n_prompts, args.new_tokens, args.native_dot))


if __name__ == "__main__":
    main()
