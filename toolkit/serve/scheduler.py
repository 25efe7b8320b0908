"""Continuous batching: one background thread owns the model and runs it step by step; requests join and leave the
running batch at token granularity.

Each turn of the loop: drop cancelled sequences (freeing their rows), admit waiting ones in arrival order while a row
and the KV token budget allow (each prefilled alone, batch 1, then copied into the slot cache), then one batched decode
step for every live row. Torch work never runs on the event loop; the HTTP layer only enqueues and receives events.

Admission counts a sequence's worst case (prompt + max_tokens) against `max_kv_tokens`, so a batch never outgrows its
memory mid-flight; the queue is bounded (`max_queue`) and `submit` refuses beyond it (HTTP 429).
"""

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from toolkit.engine.generate import Detokenizer, prefill
from toolkit.engine.kv_cache import ContiguousKVCache
from toolkit.engine.precision import exact_linears, may_overflow
from toolkit.engine.sampling import sample
from toolkit.serve.metrics import ServerMetrics
from toolkit.serve.sequence import Sequence
from toolkit.serve.slot_cache import SlotKVCache

log = logging.getLogger(__name__)

PREFILL_TOKENS_PER_TURN = 512  # prompt tokens prefilled between two decode steps (one longer request always goes)


@dataclass(frozen=True)
class Limits:
    max_batch: int = 16  # sequences decoded together
    max_queue: int = 64  # requests waiting for a row; beyond: 429
    max_kv_tokens: int = 32768  # sum of prompt + max_tokens over running sequences
    max_seq_len: int = 2048  # prompt + max_tokens of one sequence (at most the model's context)


class QueueFull(Exception):
    """The waiting queue is at max_queue; `retry_after` is a hint in seconds."""

    def __init__(self, retry_after: int):
        super().__init__("queue full")
        self.retry_after = retry_after


class Scheduler:
    def __init__(self, model, tokenizer, stop_tokens: set[int], limits: Limits, metrics: ServerMetrics):
        self.model, self.tokenizer, self.stop_tokens = model, tokenizer, stop_tokens
        self.limits, self.metrics = limits, metrics
        self.cache = SlotKVCache(model, limits.max_batch, limits.max_seq_len)
        self.device = next(model.parameters()).device
        self.running: list[Sequence] = []  # running[i] lives in cache row i
        self.waiting: deque[Sequence] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="specquant-scheduler", daemon=True)
        self._step_s = 0.05  # recent decode step time, for Retry-After
        self.peak_batch = 0  # the most rows one decode step has run (tests check batching really happened)

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
        for seq in list(self.running) + list(self.waiting):
            seq.emit({"type": "error", "message": "the server is shutting down"})

    def _turn(self) -> None:
        for seq in [s for s in self.running if s.cancelled.is_set()]:
            self._finish(seq, "cancelled")
        self._admit()
        if self.running:
            self._decode()
        self._publish()

    def _reserved(self) -> int:
        return sum(s.reserved_tokens for s in self.running)

    def _admit(self) -> None:
        # Prefill runs alone and stalls every live row: bound the prompt tokens prefilled per turn (at least one
        # request) so a burst of arrivals interleaves with decode steps instead of freezing the batch for all of them.
        budget = PREFILL_TOKENS_PER_TURN
        while budget > 0:
            with self._cond:
                gone = [s for s in self.waiting if s.cancelled.is_set()]
                for seq in gone:  # clients that left while queued: out of the queue, wherever they stood
                    self.waiting.remove(seq)
                    self.metrics.finished.labels("cancelled").inc()
                if not self.waiting or len(self.running) >= self.limits.max_batch:
                    return
                # first come, first served: the head waits for room rather than being overtaken (no starvation)
                if self.running and self._reserved() + self.waiting[0].reserved_tokens > self.limits.max_kv_tokens:
                    return
                seq = self.waiting.popleft()
                self.metrics.queue.set(len(self.waiting))
            budget -= len(seq.prompt_ids)
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
        seq.admitted = time.perf_counter()
        ids = torch.tensor([seq.prompt_ids], device=self.device)
        positions = torch.arange(ids.shape[1], device=self.device)[None]
        alone = ContiguousKVCache.for_model(self.model, ids.shape[1])
        logits = prefill(self.model, ids, None, positions, alone)
        self.metrics.prompt_tokens.inc(ids.shape[1])
        seq.detok = Detokenizer(self.tokenizer, seq.stop_strings)
        self.cache.add_row(alone)
        self.running.append(seq)
        self._accept(seq, self._sample(seq, logits[0]))

    @torch.inference_mode()
    def _decode(self) -> None:
        start = time.perf_counter()
        tokens = torch.tensor([[s.generated[-1]] for s in self.running], device=self.device)
        positions, mask = self.cache.begin_step()
        self.peak_batch = max(self.peak_batch, len(self.running))

        def run():
            return self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=self.cache,
                              use_cache=True).logits[:, -1]

        logits = run()
        if may_overflow(self.model) and not torch.isfinite(logits).all():
            with exact_linears():  # rewrites the same columns: lengths only advance in end_step
                logits = run()
        self.cache.end_step()
        for seq, row_logits in zip(list(self.running), logits):
            self._accept(seq, self._sample(seq, row_logits))
        self._step_s = 0.8 * self._step_s + 0.2 * (time.perf_counter() - start)

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
        """Take `seq` out of the batch (its row is freed at once) and send its last events."""
        row = self.running.index(seq)
        if self.cache.remove_row(row) is not None:
            self.running[row] = self.running[-1]
        self.running.pop()
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
        m.kv_allocated.set(self.cache.allocated_bytes)
        m.kv_tokens_reserved.set(self._reserved())
