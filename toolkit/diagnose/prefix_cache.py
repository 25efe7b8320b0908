"""The prefix-cache what-if: the workload's prompts, in order, through one paged KV cache with prefix reuse, as
`specquant serve prefix_cache=true` holds them (toolkit.kv.paged). Each prompt finds the whole blocks earlier
prompts registered, prefills only the rest, decodes greedily and gives its blocks back, where they stay cached for
the prompts after it. The same calling convention as benchmarks/paged.py's "prefix" part (new_sequence, then
bind / forward / commit per call), timed as generate() times a request: TTFT from the request to its first token
(prefix lookup and prefill of the remainder included), then one inter-token latency per decode step.

Keys/values reused from the cache are the ones the prompt would have computed, so greedy tokens are the baseline's
(in full precision; the report shows the measured agreement as the check)."""

import torch

from toolkit.engine.generate import paged_forward
from toolkit.kv.paged import PagedKVCache
from toolkit.timing import GenerationTiming, Stopwatch

BLOCK_SIZE = 16  # the server's default block_size (conf/serve.yaml): only whole blocks are reused


class PrefixCacheRun:
    """Runs one request at a time through a paged cache that outlives the requests."""

    def __init__(self, model):
        self.model = model
        self.cache: PagedKVCache | None = None
        self.last_cached = 0  # prompt tokens the last request found in the cache

    def start(self, encoded: list[list[int]], new_tokens: int) -> None:
        """An empty cache with room for every request of the workload to stay cached: nothing is evicted, so the
        figure is the reuse the workload itself offers (the server's default pool of max_kv_tokens=32768 holds far
        more than a diagnosed workload). Called before each timed pass, so prompt i finds only prompts 0..i-1."""
        blocks = sum(-(-(len(ids) + new_tokens) // BLOCK_SIZE) for ids in encoded)
        self.cache = PagedKVCache(self.model, blocks + 1, BLOCK_SIZE, prefix_cache=True)

    @torch.inference_mode()
    def run(self, ids: list[int], new_tokens: int) -> tuple[list[int], GenerationTiming]:
        """Greedy `new_tokens` tokens for one prompt (end-of-sequence ignored, as the other options run)."""
        if self.cache is None:
            raise RuntimeError("PrefixCacheRun.start() sizes the cache before the first run")
        watch = Stopwatch()
        seq = self.cache.new_sequence(ids, reuse_prefix=True)
        try:
            tokens = [int(paged_forward(self.model, self.cache, [seq], [ids[seq.length:]])[0].argmax(-1))]
            watch.mark()
            for _ in range(new_tokens - 1):
                tokens.append(int(paged_forward(self.model, self.cache, [seq], [[tokens[-1]]])[0].argmax(-1)))
                watch.mark()
        finally:
            self.cache.free(seq)  # its registered blocks stay in the cache for the next prompts
        self.last_cached = seq.cached_tokens
        return tokens, watch.timing(len(ids), 1)
