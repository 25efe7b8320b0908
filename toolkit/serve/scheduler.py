"""Continuous batching: one background thread owns the model and runs it step by step; requests join and leave the
running batch at token granularity.

Keys/values live in one paged block pool (toolkit.kv.paged, sized by kv_pool.py): each running sequence holds the
blocks its tokens fill, full blocks are kept under their token prefix, and a prompt that starts like an earlier one
reuses those blocks and prefills only the rest.

Each turn of the loop: drop cancelled sequences (their blocks go back at once), admit waiting ones in arrival order
while a batch row and the pool's free blocks allow (each prefilled alone, logits of its last position only), then one
batched decode step for every running sequence. Torch work never runs on the event loop; the HTTP layer only
enqueues and receives events.

Admission is by free blocks, not worst-case length: the head of the queue goes in when the pool has the blocks its
prompt needs (past its cached prefix) plus one per running sequence for the tokens they add next. Sequences grow
into the pool as they decode; when a step finds no block left, the most recently admitted sequence is preempted: its
blocks are freed and it goes back to the head of the queue, to be prefilled again later from its prompt plus what it
had generated (its full blocks usually still sit in the prefix cache, so that is cheap). Tokens already streamed are
not sent again, and greedy output does not change. The queue is bounded (`max_queue`) and `submit` refuses beyond it
(HTTP 429); a request that needs more blocks than the whole pool is refused by the HTTP layer (`fits`).
"""

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from toolkit.engine.generate import Detokenizer, takes_logits_to_keep
from toolkit.engine.precision import exact_linears, may_overflow
from toolkit.engine.sampling import sample
from toolkit.kv.paged import OutOfBlocks
from toolkit.serve.kv_pool import make_cache, prefill_cost
from toolkit.serve.metrics import ServerMetrics
from toolkit.serve.sequence import Sequence

log = logging.getLogger(__name__)

PREFILL_TOKENS_PER_TURN = 512  # prompt tokens prefilled between two decode steps (one longer request always goes)


@dataclass(frozen=True)
class Limits:
    max_batch: int = 16  # sequences decoded together
    max_queue: int = 64  # requests waiting for a row; beyond: 429
    max_kv_tokens: int = 32768  # the KV block pool in tokens (rounded up to whole blocks), unless kv_budget_mb
    max_seq_len: int = 2048  # prompt + max_tokens of one sequence (at most the model's context)
    block_size: int = 16  # tokens per KV block
    prefix_cache: bool = True  # reuse the blocks of a cached prompt prefix
    kv_budget_mb: float | None = None  # the KV block pool in MiB; when set, instead of max_kv_tokens


class QueueFull(Exception):
    """The waiting queue is at max_queue; `retry_after` is a hint in seconds."""

    def __init__(self, retry_after: int):
        super().__init__("queue full")
        self.retry_after = retry_after


class Scheduler:
    def __init__(self, model, tokenizer, stop_tokens: set[int], limits: Limits, metrics: ServerMetrics):
        self.model, self.tokenizer, self.stop_tokens = model, tokenizer, stop_tokens
        self.limits, self.metrics = limits, metrics
        self.cache = make_cache(model, limits.max_kv_tokens, limits.block_size, limits.kv_budget_mb, limits.prefix_cache)
        self.device = next(model.parameters()).device
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.waiting: deque[Sequence] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="specquant-scheduler", daemon=True)
        self._step_s = 0.05  # recent decode step time, for Retry-After
        self.peak_batch = 0  # the most rows one decode step has run (tests check batching really happened)
        self.preemptions = 0
        self.peak_blocks_used = 0
        metrics.kv_blocks_total.set(self.cache.pool.num_blocks)
        metrics.kv_allocated.set(self.cache.storage.nbytes)
        self._publish()

    @property
    def kv_capacity_tokens(self) -> int:
        return self.cache.pool.num_blocks * self.cache.block_size

    def fits(self, tokens: int) -> bool:
        """Whether a sequence of `tokens` (prompt + max_tokens) fits in the whole pool (alone, at worst)."""
        return self.cache.pool.blocks_for(tokens) <= self.cache.pool.num_blocks

    # --- called from the HTTP side ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def submit(self, seq: Sequence) -> None:
        with self._cond:
            if len(self.waiting) >= self.limits.max_queue:
                raise QueueFull(self._retry_after())
            self.waiting.append(seq)
            self.metrics.queue.set(len(self.waiting))
            self._cond.notify()

    def wake(self) -> None:
        """A sequence was cancelled: let an idle loop notice."""
        with self._cond:
            self._cond.notify()

    def _retry_after(self) -> int:
        # about the time for the running batch to make room: one decode step per token still to come, roughly
        remaining = min((s.max_tokens - len(s.generated) for s in self.running), default=1)
        return max(1, int(remaining * self._step_s + 0.999))

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    # --- the loop (scheduler thread) --------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not self._stop and not self.running and not self.waiting:
                    self._cond.wait()
                if self._stop:
                    break
            try:
                self._turn()
            except Exception as exc:  # a bug or a numerical failure: fail the live requests, keep serving
                log.exception("scheduler step failed")
                for seq in list(self.running):
                    self._finish(seq, "error", error=f"internal error: {exc}")
                self._publish()
        for seq in list(self.running) + list(self.waiting):
            seq.emit({"type": "error", "message": "the server is shutting down"})

    def _turn(self) -> None:
        for seq in [s for s in self.running if s.cancelled.is_set()]:
            self._finish(seq, "cancelled")
        self._admit()
        if self.running:
            self._decode()
        self._publish()

    def _admit(self) -> None:
        # Prefill runs alone and stalls every live row: bound the prompt tokens prefilled per turn (at least one
        # request) so a burst of arrivals interleaves with decode steps instead of freezing the batch for all of them.
        budget = PREFILL_TOKENS_PER_TURN
        pool = self.cache.pool
        while budget > 0:
            with self._cond:
                gone = [s for s in self.waiting if s.cancelled.is_set()]
                for seq in gone:  # clients that left while queued: out of the queue, wherever they stood
                    self.waiting.remove(seq)
                    self.metrics.finished.labels("cancelled").inc()
                if not self.waiting or len(self.running) >= self.limits.max_batch:
                    return
                # first come, first served: the head waits for room rather than being overtaken (no starvation).
                # Alone it always fits (fits() was checked at submission); beside others it leaves one block per
                # running sequence for their next tokens, so admitting it does not preempt someone at once.
                cost = prefill_cost(self.cache, self.waiting[0].context_ids, self.limits.prefix_cache)
                if self.running and cost.blocks + len(self.running) > pool.available:
                    return
                seq = self.waiting.popleft()
                self.metrics.queue.set(len(self.waiting))
            budget -= cost.compute_tokens
            try:
                self._prefill(seq)
            except Exception as exc:  # this request fails; the batch and the server go on
                log.exception("prefill failed")
                if seq in self.running:
                    self._finish(seq, "error", error=f"internal error: {exc}")
                else:
                    self.metrics.finished.labels("error").inc()
                    seq.emit({"type": "error", "message": f"internal error: {exc}"})

    @torch.inference_mode()
    def _prefill(self, seq: Sequence) -> None:
        if seq.admitted is None:
            seq.admitted = time.perf_counter()
        ids = seq.context_ids
        seq.kv = self.cache.new_sequence(ids, reuse_prefix=self.limits.prefix_cache)
        self.running.append(seq)  # from here on, _finish gives its blocks back whatever happens
        rest = ids[seq.kv.length:]
        logits = self._forward([seq], [rest])
        self.metrics.prompt_tokens.inc(len(rest))
        if seq.detok is None:  # a preempted sequence keeps its detokenizer: what was streamed is not sent again
            seq.detok = Detokenizer(self.tokenizer, seq.stop_strings)
        self._accept(seq, self._sample(seq, logits[0]))

    @torch.inference_mode()
    def _decode(self) -> None:
        start = time.perf_counter()
        while True:
            try:
                logits = self._forward(self.running, [[s.generated[-1]] for s in self.running])
                break
            except OutOfBlocks:
                if len(self.running) == 1:  # cannot happen for a request fits() accepted
                    raise
                self._preempt(self.running[-1])
        self.peak_batch = max(self.peak_batch, len(self.running))
        for seq, row_logits in zip(list(self.running), logits):
            self._accept(seq, self._sample(seq, row_logits))
        self._step_s = 0.8 * self._step_s + 0.2 * (time.perf_counter() - start)

    def _forward(self, seqs: list[Sequence], new_tokens: list[list[int]]) -> torch.Tensor:
        """One model call adding `new_tokens` (the same number per sequence) to `seqs`; the logits of each one's last
        position [rows, vocab]. Raises OutOfBlocks, before running anything, if the pool cannot hold the tokens."""
        positions, mask = self.cache.bind([s.kv for s in seqs], new_tokens)
        ids = torch.tensor(new_tokens, device=self.device)
        kwargs = {"logits_to_keep": 1} if takes_logits_to_keep(type(self.model)) else {}

        def run():
            return self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=self.cache,
                              use_cache=True, **kwargs).logits[:, -1]

        logits = run()
        if may_overflow(self.model) and not torch.isfinite(logits).all():
            # the overflowed call wrote garbage keys/values to the bound slots; nothing is committed until
            # commit(), so running the same binding again overwrites exactly those slots
            with exact_linears():
                logits = run()
        self.cache.commit()
        return logits

    def _preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and put it back at the head of the queue, to be recomputed from prompt + generated."""
        self.cache.free(seq.kv)
        seq.kv = None
        seq.preemptions += 1
        self.preemptions += 1
        self.metrics.preemptions.inc()
        with self._cond:  # queued before it leaves the batch: /health never sees it nowhere
            self.waiting.appendleft(seq)
            self.metrics.queue.set(len(self.waiting))
        self.running.remove(seq)

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> int:
        return int(sample(logits[None], seq.sampling, seq.generator)[0])

    def _accept(self, seq: Sequence, token: int) -> None:
        """One new token for `seq`: stream its text, finish it on a stop token/string or at max_tokens."""
        now = time.perf_counter()
        if seq.token_times:
            self.metrics.itl.observe(now - seq.token_times[-1])
        else:
            self.metrics.ttft.observe(now - seq.arrived)
        seq.token_times.append(now)
        self.metrics.count_tokens(1)
        if token in self.stop_tokens:
            self._finish(seq, "stop")
            return
        seq.generated.append(token)
        delta = seq.detok.push(seq.generated)
        if delta:
            seq.emit({"type": "token", "text": delta})
        if seq.detok.stopped:
            self._finish(seq, "stop")
        elif len(seq.generated) >= seq.max_tokens:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Take `seq` out of the batch (its blocks go back to the pool at once) and send its last events."""
        if seq.kv is not None:  # blocks first: once /health shows the batch empty, the pool is too
            self.cache.free(seq.kv)
            seq.kv = None
        self.running.remove(seq)
        seq.finish_reason = reason
        self.metrics.finished.labels(reason).inc()
        if reason in ("cancelled",):
            return
        if error is not None:
            seq.emit({"type": "error", "message": error})
            return
        rest = seq.detok.push(seq.generated, final=True)
        if rest:
            seq.emit({"type": "token", "text": rest})
        seq.emit({"type": "done", "text": seq.detok.text, "finish_reason": reason, "usage": seq.usage(),
                  "timings": seq.timings(), "token_ids": list(seq.generated)})

    def _publish(self) -> None:
        m = self.metrics
        m.batch.set(len(self.running))
        m.queue.set(len(self.waiting))
        m.kv_bytes.set(self.cache.nbytes)
        m.kv_tokens.set(sum(s.kv.length for s in self.running if s.kv is not None))
        m.publish_pool(self.cache.pool)
        self.peak_blocks_used = max(self.peak_blocks_used, self.cache.pool.used)


