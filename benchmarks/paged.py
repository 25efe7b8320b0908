"""The paged KV cache measured against the contiguous one: capacity, prefix caching, decode ITL, in one run.

    python -m benchmarks.paged [--parts capacity prefix itl] [--budget-mb 256] [--block-size 16]
                               [--system-tokens 1024] [--turns 4] [--itl-batch 8] [--itl-runs 2]
                               [--model smollm2-135m] [--threads N] [--out FILE] [--store PATH|none]

capacity  How many concurrent sequences of mixed lengths a fixed KV budget holds. One seeded stream of requests:
          prompt lengths uniform in [--prompt-min, --prompt-max], output lengths uniform in [--output-min,
          --max-tokens] (where each request stops), random token ids (no prefix is shared). Paged: requests are
          admitted in stream order into a real PagedKVCache sized by `with_budget(--budget-mb)`; each is prefilled
          (one bind/commit of its prompt) then grown one token per bind/commit, as decode grows it, to
          `mid_flight`: a seeded point of its output, uniform in [1, its output length] (a sequence caught at a
          random instant of a running batch), and `at_completion`: its full output (every sequence at its last
          token at once, the worst case). The count is the requests held when the pool's allocator raises
          OutOfBlocks (no model call: capacity is bookkeeping; the allocator decides). Preallocated, from the same
          byte budget and the pool's real bytes per token, same stream, same order: `prompt_plus_max_tokens`
          (each request reserves prompt + max_tokens, as generate() sizes a ContiguousKVCache for a batch of one
          and as the server's admission counts), `left_padded_batch` (one ContiguousKVCache batch: every row
          reserves the longest prompt + max_tokens, as generate() sizes it), `max_seq_len` (each request a
          --max-seq-len slot). Headline ratio: paged mid_flight / prompt_plus_max_tokens.
prefix    A --system-tokens shared system prompt (pydoc prose, evaluation split) followed by distinct short user
          turns ("\\n\\nUser: <~--turn-tokens of prose>\\nAssistant:"). One warm-up turn (reuse on: a miss, it
          fills the prefix cache; reported as `cold_ttft_ms`), then --turns turns, each run with prefix reuse and
          without (reuse_prefix=False: the whole prompt prefilled), the order alternating per turn. TTFT = new
          sequence -> first token's logits (prefix lookup, bind, forward, commit, argmax). Each then decodes
          --prefix-new-tokens greedy tokens; `identical_outputs`: reuse == no reuse on every turn, and
          `identical_to_engine`: turn 0 == the engine's generate() on a contiguous cache.
itl       One batch of --itl-batch prompts (prose, lengths uniform in [--itl-prompt-min, --itl-prompt-max]),
          --itl-new-tokens greedy tokens. Contiguous: the engine's left-padded batch (left_pad, prefill,
          decode_step over a ContiguousKVCache, as generate() runs it). Paged: each prompt prefilled alone, then
          one bind/forward/commit per step over all rows. Both prefill once; each of --itl-runs runs rolls both
          caches back to the prompts and decodes again, step i of both before step i+1 of either, which goes
          first alternating per step. ITL = one decode step (forward + argmax; paged includes bind and commit).
          Median per path over every step of every run, ratio paged / contiguous; `identical_outputs`: the same
          tokens on every run.

Model: SmolLM2-135M loaded by the engine (load_engine_model, --dtype auto as the engine runs it: on this CPU fp16 weights through fbgemm, fp32 activations and KV). Timings are only
comparable within one run (this machine is shared and noisy); the ratios are what the run measures.
"""

import argparse
import random
import statistics
import time

import torch

from toolkit.engine.generate import (
    decode_step,
    generate,
    left_pad,
    paged_forward,
    positions_from_mask,
    prefill,
    stop_token_ids,
)
from toolkit.errors import InputError
from toolkit.kv.contiguous import ContiguousKVCache
from toolkit.kv.paged import OutOfBlocks, PagedKVCache

MIB = 1 << 20


# --- paged generation: the calling convention of toolkit.kv.paged.cache (toolkit.engine.generate.paged_forward) -
def paged_greedy(model, cache: PagedKVCache, prompt: list[int], new_tokens: int, reuse_prefix: bool):
    """Greedy tokens for one prompt; returns (tokens, seconds to the first token, the sequence - caller frees it)."""
    start = time.perf_counter()
    seq = cache.new_sequence(prompt, reuse_prefix=reuse_prefix)
    token = int(paged_forward(model, cache, [seq], [prompt[seq.length:]]).argmax(-1))
    ttft = time.perf_counter() - start
    tokens = [token]
    for _ in range(new_tokens - 1):
        tokens.append(int(paged_forward(model, cache, [seq], [[tokens[-1]]]).argmax(-1)))
    return tokens, ttft, seq


# --- 1. capacity ------------------------------------------------------------------------------------------------------
def request_stream(seed: int, count: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                   vocab: int) -> list[dict]:
    """`count` requests: prompt ids, where the request stops, and how far it got at a random instant."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        prompt = rng.randint(*prompt_range)
        output = rng.randint(*output_range)
        requests.append({"prompt": [rng.randrange(vocab) for _ in range(prompt)], "at_completion": output,
                         "mid_flight": rng.randint(1, output)})
    return requests


def fill_paged(model, budget_bytes: int, block_size: int, requests: list[dict], stage: str) -> dict:
    """Admit requests in order into a real pool, each grown to `stage` tokens of output, until OutOfBlocks."""
    cache = PagedKVCache.with_budget(model, budget_bytes, block_size)
    held, tokens = 0, 0
    for i, request in enumerate(requests):
        seq = cache.new_sequence(request["prompt"], reuse_prefix=False)
        grow = request[stage]
        try:
            cache.bind([seq], [request["prompt"]])
            cache.commit()
            for step in range(grow - 1):  # the first output token comes from the prefill; the rest one per step
                cache.bind([seq], [[request["prompt"][step % len(request["prompt"])]]])  # any token will do
                cache.commit()
        except OutOfBlocks:  # bind binds nothing when it fails; the blocks this request did get go back
            cache.free(seq)
            break
        held, tokens = i + 1, tokens + seq.length
    else:
        raise InputError(f"all {len(requests)} requests fit in {budget_bytes / MIB:g} MiB", "lower --budget-mb")
    pool = cache.pool
    return {"bytes_per_token": cache.bytes_per_block_held / block_size, "sequences": held, "tokens_held": tokens,
            "blocks_used": pool.used, "blocks_total": pool.num_blocks,
            "bytes_used": pool.used * cache.bytes_per_block_held, "pool_bytes": cache.storage.nbytes,
            "token_utilisation": tokens / (pool.used * block_size) if pool.used else 0.0}


def preallocated_counts(requests: list[dict], budget_bytes: int, per_token: float, max_tokens: int,
                        max_seq_len: int) -> dict:
    """Requests that fit when each reserves its worst case up front, admitted in the same order."""
    budget_tokens = budget_bytes / per_token

    def in_order(reserve) -> int:
        total = 0
        for i, request in enumerate(requests):
            total += reserve(request)
            if total > budget_tokens:
                return i
        return len(requests)

    batch = 0  # rows of one left-padded batch: all reserve the longest prompt so far + max_tokens
    longest = 0
    for i, request in enumerate(requests):
        longest = max(longest, len(request["prompt"]))
        if (i + 1) * (longest + max_tokens) > budget_tokens:
            break
        batch = i + 1
    reserved = in_order(lambda r: len(r["prompt"]) + max_tokens)
    admitted = requests[:reserved]
    held = sum(len(r["prompt"]) + r["mid_flight"] for r in admitted)
    return {"prompt_plus_max_tokens": reserved, "left_padded_batch": batch,
            "max_seq_len": int(budget_tokens // max_seq_len),
            # of the slots prompt + max_tokens reserves, the share its admitted requests fill mid flight
            "prompt_plus_max_tokens_utilisation": held / sum(len(r["prompt"]) + max_tokens for r in admitted)
            if admitted else None}


def capacity(model, budget_mb: float, block_size: int, prompt_range, output_range, max_seq_len: int, seed: int,
             count: int | None = None) -> dict:
    budget_bytes = int(budget_mb * MIB)
    per_token = PagedKVCache.bytes_per_block(model, block_size) / block_size
    if max_seq_len < prompt_range[1] + output_range[1]:
        raise InputError(f"--max-seq-len {max_seq_len} < longest prompt + max_tokens "
                         f"({prompt_range[1] + output_range[1]})", "raise --max-seq-len")
    count = count or int(budget_bytes / per_token // (prompt_range[0] + 1)) + 2  # more than any budget holds
    vocab = model.config.get_text_config(decoder=True).vocab_size
    requests = request_stream(seed, count, prompt_range, output_range, vocab)
    paged = {stage: fill_paged(model, budget_bytes, block_size, requests, stage)
             for stage in ("mid_flight", "at_completion")}
    per_token = paged["mid_flight"].pop("bytes_per_token")  # the real pool's, for the baselines too
    paged["at_completion"].pop("bytes_per_token")
    baseline = preallocated_counts(requests, budget_bytes, per_token, output_range[1], max_seq_len)
    utilisation = baseline.pop("prompt_plus_max_tokens_utilisation")
    head = baseline["prompt_plus_max_tokens"]
    return {"budget_bytes": budget_bytes, "bytes_per_token": per_token, "block_size": block_size,
            "paged": paged, "preallocated": baseline, "preallocated_utilisation_mid_flight": utilisation,
            "ratio": paged["mid_flight"]["sequences"] / head if head else None,
            "ratios": {f"{stage}_vs_{name}": (paged[stage]["sequences"] / n if n else None)
                       for stage in paged for name, n in baseline.items()},
            "protocol": {"requests": count, "seed": seed, "prompt_tokens": list(prompt_range),
                         "output_tokens": list(output_range), "max_tokens": output_range[1],
                         "max_seq_len": max_seq_len, "text": "see benchmarks/paged.py: capacity"}}


# --- 2. prefix caching ------------------------------------------------------------------------------------------------
def chat_prompts(tokenizer, system_tokens: int, turns: int, turn_tokens: int, seed: int) -> tuple[list, list]:
    """The shared system prompt's ids and `turns` distinct user turns' ids (appended to it by the caller)."""
    from toolkit.data import build_prompts

    # a longer clean passage cut to exactly `system_tokens` tokens (a cut mid-sentence is fine in a system prompt)
    system = tokenizer(build_prompts("open", tokenizer, system_tokens + 64, 1, seed=seed)[0].text).input_ids
    if len(system) < system_tokens:
        raise InputError(f"the prompt set has no passage of {system_tokens} tokens", "lower --system-tokens")
    system = system[:system_tokens]
    passages = build_prompts("open", tokenizer, turn_tokens, turns, seed=seed + 1)
    user = [tokenizer(f"\n\nUser: {p.text}\nAssistant:", add_special_tokens=False).input_ids for p in passages]
    return system, user


PATHS = ("reuse", "no_reuse")


@torch.inference_mode()
def prefix_ttft(model, tokenizer, system_tokens: int, turns: int, turn_tokens: int, new_tokens: int,
                block_size: int, seed: int) -> dict:
    system, user = chat_prompts(tokenizer, system_tokens, turns + 1, turn_tokens, seed)
    prompts = [system + u for u in user]
    longest = max(len(p) for p in prompts) + new_tokens
    # one cache per path, each with room for a live sequence and the cached system prompt (nothing is evicted): a
    # shared one would let the no-reuse run register the very prompt the reuse run then finds
    caches = {path: PagedKVCache(model, 3 * -(-longest // block_size) + 2, block_size) for path in PATHS}
    cold = {}
    for path, cache in caches.items():  # warm-up: first calls pay one-off costs; the reuse cache gets the system prompt
        _, cold[path], seq = paged_greedy(model, cache, prompts[0], new_tokens, reuse_prefix=path == "reuse")
        cache.free(seq)
    ttft = {path: [] for path in PATHS}
    outputs = {path: [] for path in PATHS}
    cached = []
    for turn, prompt in enumerate(prompts[1:]):
        for path in PATHS if turn % 2 == 0 else reversed(PATHS):
            cache = caches[path]
            out, seconds, seq = paged_greedy(model, cache, prompt, new_tokens, reuse_prefix=path == "reuse")
            if path == "reuse":
                cached.append(seq.cached_tokens)
            cache.free(seq)
            ttft[path].append(seconds)
            outputs[path].append(out)
    engine = generate(model, tokenizer, [prompts[1]], new_tokens, stop_tokens=set()).sequences[0].token_ids
    same = [a == b for a, b in zip(outputs["reuse"], outputs["no_reuse"])]
    p50 = {path: statistics.median(v) * 1e3 for path, v in ttft.items()}
    stats = caches["reuse"].pool.stats
    return {"ttft_ms_p50": p50, "ttft_ms": {p: [s * 1e3 for s in v] for p, v in ttft.items()},
            "cold_ttft_ms": cold["reuse"] * 1e3, "speedup": p50["no_reuse"] / p50["reuse"],
            "cached_tokens": cached, "identical_outputs": all(same), "identical_turns": f"{sum(same)}/{len(same)}",
            "identical_to_engine": outputs["reuse"][0] == engine and outputs["no_reuse"][0] == engine,
            "prefix_hit_rate": stats.hit_rate, "cow_copies": stats.cow_copies, "evictions": stats.evictions,
            "protocol": {"system_tokens": len(system), "turn_tokens": [len(u) for u in user[1:]], "turns": turns,
                         "new_tokens": new_tokens, "block_size": block_size, "seed": seed,
                         "text": "see benchmarks/paged.py: prefix"}}


# --- 3. decode ITL ----------------------------------------------------------------------------------------------------
class ContiguousBatch:
    """The engine's batch: left-padded, prefilled once, decoded by decode_step over a ContiguousKVCache."""

    def __init__(self, model, prompts: list[list[int]], pad_id: int, new_tokens: int):
        self.model = model
        ids, self.mask0 = left_pad(prompts, pad_id)
        self.padded = bool((self.mask0 == 0).any())
        self.width = ids.shape[1]
        positions = positions_from_mask(self.mask0)
        self.cache = ContiguousKVCache.for_model(model, self.width + new_tokens)
        self.first = prefill(model, ids, self.mask0 if self.padded else None, positions, self.cache).argmax(-1)
        self.pos0 = positions[:, -1:]
        self.reset()

    def reset(self) -> list[int]:
        self.cache.crop(self.width)
        self.mask, self.pos, self.tokens = self.mask0, self.pos0, self.first
        return self.tokens.tolist()

    def step(self) -> list[int]:
        if self.padded:
            self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        self.pos = self.pos + 1
        logits = decode_step(self.model, self.tokens[:, None], self.mask if self.padded else None, self.pos,
                             self.cache)
        self.tokens = logits.argmax(-1)
        return self.tokens.tolist()


class PagedBatch:
    """The same prompts in a PagedKVCache: each prefilled alone, then decoded together behind the per-row mask."""

    def __init__(self, model, prompts: list[list[int]], new_tokens: int, block_size: int):
        self.model, self.prompts = model, prompts
        blocks = sum(-(-(len(p) + new_tokens) // block_size) for p in prompts) + len(prompts)
        self.cache = PagedKVCache(model, blocks, block_size)
        self.seqs, self.first = [], []
        for prompt in prompts:
            seq = self.cache.new_sequence(prompt, reuse_prefix=False)
            self.first.append(int(paged_forward(model, self.cache, [seq], [prompt]).argmax(-1)))
            self.seqs.append(seq)
        self.reset()

    def reset(self) -> list[int]:
        for seq, prompt in zip(self.seqs, self.prompts):
            self.cache.crop_sequence(seq, len(prompt))
        self.tokens = list(self.first)
        return self.tokens

    def step(self) -> list[int]:
        logits = paged_forward(self.model, self.cache, self.seqs, [[t] for t in self.tokens])
        self.tokens = logits.argmax(-1).tolist()
        return self.tokens


def itl_prompts(tokenizer, batch: int, length_range: tuple[int, int], seed: int) -> list[list[int]]:
    from toolkit.data import build_prompts

    rng = random.Random(seed)
    lengths = [rng.randint(*length_range) for _ in range(batch)]
    texts = build_prompts("open", tokenizer, length_range[1] + 16, batch, seed=seed)
    prompts = [tokenizer(p.text).input_ids[:n] for p, n in zip(texts, lengths)]
    if any(len(p) < length_range[0] for p in prompts):
        raise InputError(f"the prompt set has passages shorter than {length_range[0]} tokens",
                         "lower --itl-prompt-min")
    return prompts


@torch.inference_mode()
def decode_itl(model, tokenizer, batch: int, length_range: tuple[int, int], new_tokens: int, runs: int,
               block_size: int, seed: int) -> dict:
    prompts = itl_prompts(tokenizer, batch, length_range, seed)
    stops = stop_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(stops), 0)
    paths = {"contiguous": ContiguousBatch(model, prompts, pad_id, new_tokens),
             "paged": PagedBatch(model, prompts, new_tokens, block_size)}
    times = {name: [] for name in paths}
    outputs = {name: [] for name in paths}
    for run in range(runs):
        tokens = {name: [path.reset()] for name, path in paths.items()}
        for step in range(new_tokens - 1):
            order = list(paths) if (run + step) % 2 == 0 else list(reversed(paths))
            for name in order:
                start = time.perf_counter()
                tokens[name].append(paths[name].step())
                times[name].append(time.perf_counter() - start)
        for name in paths:  # [steps][rows] -> one list of tokens per row
            outputs[name].append([list(row) for row in zip(*tokens[name])])
    p50 = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    same = [a == b for a, b in zip(outputs["paged"], outputs["contiguous"])]
    per_run = {name: [statistics.median(t[r * (new_tokens - 1):(r + 1) * (new_tokens - 1)]) * 1e3
                      for r in range(runs)] for name, t in times.items()}
    rows_same = [a == b for a, b in zip(outputs["paged"][0], outputs["contiguous"][0])]
    return {"itl_ms_p50": p50, "itl_ms_p50_per_run": per_run, "ratio": p50["paged"] / p50["contiguous"],
            "identical_outputs": all(same), "identical_rows": f"{sum(rows_same)}/{len(rows_same)}",
            "protocol": {"batch": batch, "prompt_tokens": [len(p) for p in prompts], "new_tokens": new_tokens,
                         "runs": runs, "steps_per_run": new_tokens - 1, "block_size": block_size, "seed": seed,
                         "text": "see benchmarks/paged.py: itl"}}


# --- the run ----------------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["capacity", "prefix", "itl"], choices=["capacity", "prefix", "itl"])
    p.add_argument("--model", default="smollm2-135m", help="registry name or directory")
    p.add_argument("--dtype", default="auto", help="engine.dtype (activations and KV)")
    p.add_argument("--weight-dtype", default="auto", help="engine.weight_dtype (auto: as --dtype when explicit)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("capacity")
    g.add_argument("--budget-mb", type=float, default=256.0, help="KV memory budget in MiB")
    g.add_argument("--prompt-min", type=int, default=64)
    g.add_argument("--prompt-max", type=int, default=1024)
    g.add_argument("--output-min", type=int, default=16)
    g.add_argument("--max-tokens", type=int, default=512)
    g.add_argument("--max-seq-len", type=int, default=2048, help="slot size of the max_seq_len baseline")
    g = p.add_argument_group("prefix")
    g.add_argument("--system-tokens", type=int, default=1024)
    g.add_argument("--turns", type=int, default=4, help="timed turns per path")
    g.add_argument("--turn-tokens", type=int, default=24, help="prose tokens per user turn (+ ~6 of template)")
    g.add_argument("--prefix-new-tokens", type=int, default=16)
    g = p.add_argument_group("itl")
    g.add_argument("--itl-batch", type=int, default=8)
    g.add_argument("--itl-prompt-min", type=int, default=192)
    g.add_argument("--itl-prompt-max", type=int, default=384)
    g.add_argument("--itl-new-tokens", type=int, default=64)
    g.add_argument("--itl-runs", type=int, default=2)
    p.add_argument("--out", default=None, help="result JSON (default: $SPECQUANT_HOME/bench-paged.json)")
    p.add_argument("--store", default=None, help="results store (default: $SPECQUANT_STORE or "
                                                 "$SPECQUANT_HOME/results.jsonl; none: do not append)")
    args = p.parse_args(argv)
    _check(args)
    return args


def _check(args) -> None:
    positive = ("block_size", "budget_mb", "prompt_min", "output_min", "max_tokens", "system_tokens", "turns",
                "turn_tokens", "prefix_new_tokens", "itl_batch", "itl_prompt_min", "itl_new_tokens", "itl_runs")
    for name in positive:
        if getattr(args, name) <= 0:
            raise InputError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}",
                             "give a positive value")
    for lo, hi in (("prompt_min", "prompt_max"), ("output_min", "max_tokens"), ("itl_prompt_min", "itl_prompt_max")):
        if getattr(args, lo) > getattr(args, hi):
            raise InputError(f"--{lo.replace('_', '-')} {getattr(args, lo)} > --{hi.replace('_', '-')} "
                             f"{getattr(args, hi)}", "give a range with min <= max")
    if args.itl_new_tokens < 2 or args.prefix_new_tokens < 1:
        raise InputError("--itl-new-tokens must be >= 2 (one decode step)", "raise --itl-new-tokens")


def run(args) -> dict:
    from toolkit.engine.setup import default_engine_config, load_engine_model
    from toolkit.machine import machine_facts

    engine = default_engine_config(dtype=args.dtype, weight_dtype=args.weight_dtype, threads=args.threads)
    loaded = load_engine_model(args.model, engine)
    model, tok = loaded.model, loaded.tokenizer
    figures = {"model": loaded.name, "dtype": loaded.precision.name, "kv": "paged", "threads": torch.get_num_threads(),
               "attention": model.config._attn_implementation}
    print(f"{loaded.name} ({loaded.precision.name}, attention {figures['attention']}), "
          f"{figures['threads']} threads, block size {args.block_size}", flush=True)
    if "capacity" in args.parts:
        figures["capacity"] = capacity(model, args.budget_mb, args.block_size, (args.prompt_min, args.prompt_max),
                                       (args.output_min, args.max_tokens), args.max_seq_len, args.seed)
        print_capacity(figures["capacity"])
    if "prefix" in args.parts:
        figures["prefix"] = prefix_ttft(model, tok, args.system_tokens, args.turns, args.turn_tokens,
                                        args.prefix_new_tokens, args.block_size, args.seed)
        print_prefix(figures["prefix"])
    if "itl" in args.parts:
        figures["itl"] = decode_itl(model, tok, args.itl_batch, (args.itl_prompt_min, args.itl_prompt_max),
                                    args.itl_new_tokens, args.itl_runs, args.block_size, args.seed)
        print_itl(figures["itl"])
    figures["acceptance"] = acceptance(figures)
    from toolkit.results import make_result

    # the flags under "args": the report reads config["model"] as a model config node, not a name
    return make_result("bench", {"bench": "paged", "args": vars(args)}, figures, machine_facts(measure=False))


def acceptance(figures: dict) -> dict:
    """Issue 8's three goals against this run's figures (None: part not run)."""
    cap, pre, itl = figures.get("capacity"), figures.get("prefix"), figures.get("itl")
    return {"capacity_3x": None if not cap or cap["ratio"] is None else cap["ratio"] >= 3,
            "prefix_ttft_5x": None if not pre else pre["speedup"] >= 5 and pre["identical_outputs"],
            "itl_within_10pct": None if not itl else itl["ratio"] <= 1.10 and itl["identical_outputs"]}


def print_capacity(c: dict) -> None:
    pr, pa = c["protocol"], c["paged"]
    print(f"capacity: {c['budget_bytes'] / MIB:g} MiB KV budget, {c['bytes_per_token']:.0f} B/token; prompts "
          f"{pr['prompt_tokens'][0]}-{pr['prompt_tokens'][1]}, outputs {pr['output_tokens'][0]}-{pr['max_tokens']} "
          f"tokens (max_tokens {pr['max_tokens']})")
    for stage, r in pa.items():
        print(f"  paged {stage:13} {r['sequences']:4} sequences ({r['tokens_held']} tokens in {r['blocks_used']}/"
              f"{r['blocks_total']} blocks, {r['token_utilisation']:.1%} of their slots)")
    for name, n in c["preallocated"].items():
        label = f"max_seq_len={pr['max_seq_len']}" if name == "max_seq_len" else name
        print(f"  preallocated {label:22} {n:4} sequences   paged mid_flight / this = "
              f"{_ratio(c['ratios'][f'mid_flight_vs_{name}'])}, at_completion / this = "
              f"{_ratio(c['ratios'][f'at_completion_vs_{name}'])}")
    util = c["preallocated_utilisation_mid_flight"]
    if util is not None:
        print(f"  prompt + max_tokens reservations are {util:.1%} filled mid flight; paged blocks "
              f"{pa['mid_flight']['token_utilisation']:.1%}")
    print(f"  => paged (mid flight) vs prompt + max_tokens: {_ratio(c['ratio'])} (goal >= 3x)", flush=True)


def print_prefix(p: dict) -> None:
    pr = p["protocol"]
    print(f"prefix: {pr['system_tokens']}-token system prompt + turns of {_span(pr['turn_tokens'])} tokens, "
          f"{pr['turns']} turns per path, {pr['new_tokens']} new tokens greedy")
    print(f"  TTFT p50 with reuse {p['ttft_ms_p50']['reuse']:.1f} ms, without {p['ttft_ms_p50']['no_reuse']:.1f} ms "
          f"(cold first turn {p['cold_ttft_ms']:.1f} ms); cached tokens per turn {p['cached_tokens']}")
    print(_verdict(f"TTFT {p['speedup']:.2f}x lower with prefix caching", ">= 5x", p["identical_outputs"],
                   p["identical_turns"]) + f", identical to engine {p['identical_to_engine']}", flush=True)


def print_itl(r: dict) -> None:
    pr, p50 = r["protocol"], r["itl_ms_p50"]
    per_run = ", ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(*r["itl_ms_p50_per_run"].values()))  # contiguous/paged
    print(f"itl: batch {pr['batch']}, prompts {_span(pr['prompt_tokens'])} tokens, {pr['new_tokens']} new tokens, "
          f"{pr['runs']} runs (steps interleaved)")
    print(f"  median ITL contiguous {p50['contiguous']:.2f} ms, paged {p50['paged']:.2f} ms (per run: {per_run})")
    print(_verdict(f"paged / contiguous ITL {r['ratio']:.3f}", "<= 1.10", r["identical_outputs"],
                   f"rows {r['identical_rows']}"), flush=True)


def _span(values) -> str:
    return f"{min(values)}-{max(values)}"


def _verdict(measured: str, goal: str, identical: bool, which: str) -> str:
    """A part's last line: its figure against the goal, and whether both paths generated the same tokens."""
    return f"  => {measured} (goal {goal}); identical outputs {identical} ({which})"


def _ratio(x) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    from toolkit.paths import home
    from toolkit.results import append_to_store, write_result

    out = write_result(args.out or home() / "bench-paged.json", result)
    print(f"wrote {out}")
    if stored := append_to_store(result, args.store):
        print(f"appended to {stored}")
    print("acceptance:", ", ".join(f"{k} {v}" for k, v in result["acceptance"].items()))
    return result


if __name__ == "__main__":
    main()
