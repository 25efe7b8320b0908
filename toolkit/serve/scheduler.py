"""Continuous batching: one background thread owns the model and runs it step by step; requests join and leave the
running batch at token granularity.

Keys/values live in one paged block pool (toolkit.kv.paged, sized by kv_pool.py): each running sequence holds the
blocks its tokens fill, full blocks are kept under their token prefix, and a prompt that starts like an earlier one
reuses those blocks and prefills only the rest.

Each turn of the loop: drop cancelled sequences (their blocks go back at once), admit waiting ones in arrival order
while a batch row and the pool's free blocks allow (each prefilled alone, logits of its last position only), then one
batched decode step for every running sequence. Torch work never runs on the event loop; the HTTP layer only
enqueues and receives events. A batched step's attention reads rows in buckets of similar length
(toolkit.kv.paged.attention) rather than padding every row to the longest.

Admission is by free blocks, not worst-case length: the head of the queue goes in when the pool has the blocks its
prompt needs (past its cached prefix) plus one per running sequence for the tokens they add next. Sequences grow
into the pool as they decode; when a step finds no block left, the most recently admitted sequence is preempted: its
blocks are freed and it goes back to the head of the queue, to be prefilled again later from its prompt plus what it
had generated (its full blocks usually still sit in the prefix cache, so that is cheap). Tokens already streamed are
not sent again, and greedy output does not change. The queue is bounded (`max_queue`) and `submit` refuses beyond it
(HTTP 429); a request that needs more blocks than the whole pool is refused by the HTTP layer (`fits`).

Quantized KV (kv=int8|int4|int2): blocks are quantized once their sequence is kv.residual tokens past them; until then
their tokens sit in full-precision staging slots (kv_pool.py sizes them for max_batch rows and one prefill call). A
prompt is prefilled in calls of QUANTIZED_PREFILL_CHUNK tokens, each sealing what falls behind the residual window.
Admission checks the free staging slots too; a prefill that still finds none (OutOfBlocks) goes back to the head of
the queue (its committed chunks stay in the prefix cache), and a decode step that finds none preempts as for blocks.

Speculative decoding (spec=lookup; speculation.py): while the running batch has at most spec.max_batch rows, a decode
turn drafts up to k tokens per row by prompt lookup and verifies every row in ONE call of q = (longest draft) + 1
tokens per row; each row keeps its own accepted prefix plus the target's next token, and is cropped back to what it
kept (the rejected tail's blocks go back to the pool). A turn where nobody drafted anything, or whose verify pass
does not fit in the pool, is a plain decode step instead: speculation never preempts anyone.

Fault isolation: one request's failure ends that request only. Sampling, verifying and streaming run row by row, each
guarded: a row that raises is finished with an error event (its blocks freed) and the other rows keep their tokens.
A batched model call that raises is rolled back (nothing was committed) and rerun row by row from each row's KV
state, so only the rows that fail alone are failed. Only a failure outside any request's work (a bug in the loop
itself) fails the whole batch.

Draining (graceful shutdown): `abort_all` ends every running and waiting sequence at the next turn with
finish_reason "abort" (a normal final event carrying what was generated so far).
"""

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from toolkit.engine.generate import Detokenizer, paged_forward
from toolkit.engine.precision import bf16_prefill
from toolkit.engine.sampling import sample
from toolkit.kv import KVSpec
from toolkit.kv.paged import OutOfBlocks
from toolkit.kv.paged.attention import use_paged_attention
from toolkit.serve.kv_pool import (
    make_cache,
    prefill_cost,
    residual_tokens,
    staging_blocks,
)
from toolkit.serve.metrics import ServerMetrics
from toolkit.serve.sequence import Sequence
from toolkit.serve.speculation import ServeSpec, check_kv, verify_row

log = logging.getLogger(__name__)

PREFILL_TOKENS_PER_TURN = 512  # prompt tokens prefilled between two decode steps (one longer request always goes)
# Quantized KV: a prompt is prefilled in calls of at most this many tokens. Each call's tokens sit in full-precision
# staging slots until its commit seals them, so the staging the pool needs is set by this, not by max_seq_len.
QUANTIZED_PREFILL_CHUNK = 512


@dataclass(frozen=True)
class Limits:
    max_batch: int = 16  # sequences decoded together
    max_queue: int = 64  # requests waiting for a row; beyond: 429
    max_kv_tokens: int = 32768  # the KV block pool in tokens (rounded up to whole blocks), unless kv_budget_mb
    max_seq_len: int = 2048  # prompt + max_tokens of one sequence (at most the model's context)
    block_size: int = 16  # tokens per KV block
    prefix_cache: bool = True  # reuse the blocks of a cached prompt prefix
    kv_budget_mb: float | None = None  # the KV block pool in MiB; when set, instead of max_kv_tokens
    kv: KVSpec = field(default_factory=KVSpec)  # the KV cache settings: full-precision or quantized blocks


class QueueFull(Exception):
    """The waiting queue is at max_queue; `retry_after` is a hint in seconds."""

    def __init__(self, retry_after: int):
        super().__init__("queue full")
        self.retry_after = retry_after


class Scheduler:
    def __init__(self, model, tokenizer, stop_tokens: set[int], limits: Limits, metrics: ServerMetrics,
                 spec: ServeSpec | None = None):
        self.model, self.tokenizer, self.stop_tokens = model, tokenizer, stop_tokens
        self.limits, self.metrics, self.spec = limits, metrics, spec
        check_kv(spec, residual_tokens(limits.kv))
        use_paged_attention(model)  # rows of different lengths attend without padding to the longest
        self.cache = make_cache(model, limits.max_kv_tokens, limits.block_size, limits.kv_budget_mb,
                                limits.prefix_cache, kv=limits.kv, max_sequences=limits.max_batch,
                                step_tokens=spec.max_draft + 1 if spec else 1,
                                prefill_tokens=min(limits.max_seq_len, QUANTIZED_PREFILL_CHUNK))
        # full-precision blocks: one call per prompt (chunks would change nothing but the arithmetic's order)
        self.quantized = hasattr(self.cache.storage, "staging_available")
        self.prefill_chunk = QUANTIZED_PREFILL_CHUNK if self.quantized else None
        self.device = next(model.parameters()).device
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.waiting: deque[Sequence] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._abort = False  # abort_all() asked: end every sequence at the next turn
        self._thread = threading.Thread(target=self._loop, name="specquant-scheduler", daemon=True)
        self._step_s = 0.05  # recent decode step time, for Retry-After
        self.peak_batch = 0  # the most rows one decode step has run (tests check batching really happened)
        self.preemptions = 0
        self.peak_blocks_used = 0
        self.spec_rounds = 0  # verify passes run
        self.spec_proposed = self.spec_accepted = 0  # drafted tokens, over every request since start
        self.requeued = 0  # prefills put back in the queue for want of staging slots
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

    def abort_all(self) -> None:
        """End every running and waiting sequence at the next turn with finish_reason "abort" (draining)."""
        with self._cond:
            if self.running or self.waiting:
                self._abort = True
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
            except Exception as exc:  # a bug in the loop itself (request work is isolated): fail the batch, go on
                log.exception("scheduler step failed")
                for seq in list(self.running):
                    self._fail(seq, f"internal error: {exc}")
                self._publish()
        for seq in list(self.running) + list(self.waiting):
            seq.emit({"type": "error", "message": "the server is shutting down"})

    def _turn(self) -> None:
        with self._cond:
            abort, self._abort = self._abort, False
            aborted = list(self.waiting) if abort else []
            if abort:
                self.waiting.clear()
        if abort:
            for seq in list(self.running) + aborted:
                self._guarded(seq, lambda seq=seq: self._finish(seq, "abort"))
        for seq in [s for s in self.running if s.cancelled.is_set()]:
            self._guarded(seq, lambda seq=seq: self._finish(seq, "cancelled"))
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
                if self.running and (cost.blocks + len(self.running) > pool.available
                                     or not self._staging_allows(min(cost.compute_tokens,
                                                                     self.prefill_chunk or cost.compute_tokens))):
                    return
                seq = self.waiting.popleft()
                self.metrics.queue.set(len(self.waiting))
            budget -= cost.compute_tokens
            try:
                self._prefill(seq)
            except OutOfBlocks as exc:  # no staging slot left for its prompt (quantized KV)
                if seq in self.running and len(self.running) > 1:  # the others will make room: wait at the head
                    self._requeue(seq)
                    self.requeued += 1
                    return
                self._fail_prefill(seq, f"the KV pool cannot hold this prompt: {exc}")
            except Exception as exc:  # this request fails; the batch and the server go on
                self._fail_prefill(seq, f"internal error: {exc}")

    def _fail_prefill(self, seq: Sequence, message: str) -> None:
        log.exception("prefill failed")
        self._fail(seq, message)

    def _staging_allows(self, prefill_tokens: int) -> bool:
        """Whether a quantized pool has the staging slots a prefill of `prefill_tokens` takes, plus one per running
        sequence for its next block (always true for full-precision blocks)."""
        storage = self.cache.storage
        if not self.quantized:
            return True
        storage.settle()  # blocks sealed by the last commit give their slots back only when quantized
        return staging_blocks(self.cache, prefill_tokens) + len(self.running) <= storage.staging_available

    @torch.inference_mode()
    def _prefill(self, seq: Sequence) -> None:
        if seq.admitted is None:
            seq.admitted = time.perf_counter()
        ids = seq.context_ids
        seq.kv = self.cache.new_sequence(ids, reuse_prefix=self.limits.prefix_cache)
        self.running.append(seq)  # from here on, _finish gives its blocks back whatever happens
        rest = ids[seq.kv.length:]
        chunk = self.prefill_chunk or len(rest)
        with bf16_prefill():  # bf16 products where the model was prepared for them (engine.prefill_dtype)
            for start in range(0, len(rest), chunk):
                logits = self._forward([seq], [rest[start:start + chunk]])
        self.metrics.prompt_tokens.inc(len(rest))
        self._ensure_detok(seq)
        self._accept(seq, self._sample(seq, logits[0]))

    def _ensure_detok(self, seq: Sequence) -> None:
        if seq.detok is None:  # a preempted sequence keeps its detokenizer: what was streamed is not sent again
            seq.detok = Detokenizer(self.tokenizer, seq.stop_strings)

    @torch.inference_mode()
    def _decode(self) -> None:
        start = time.perf_counter()
        self.peak_batch = max(self.peak_batch, len(self.running))
        if not (self.spec is not None and len(self.running) <= self.spec.max_batch and self._speculate()):
            self._decode_one()
        self._step_s = 0.8 * self._step_s + 0.2 * (time.perf_counter() - start)

    def _decode_one(self) -> None:
        """One token for every running sequence."""
        while True:
            try:
                logits = self._forward(self.running, [[s.generated[-1]] for s in self.running])
                break
            except OutOfBlocks:
                if len(self.running) == 1:  # cannot happen for a request fits() accepted
                    raise
                self._preempt(self.running[-1])
            except Exception:  # the batched call failed: find the row(s) that fail alone, the others go on
                log.exception("batched decode step failed; rerunning its rows one by one")
                self._decode_rows_alone()
                return
        for seq, row_logits in zip(list(self.running), logits):
            self._guarded(seq, lambda seq=seq, row_logits=row_logits: self._accept(seq, self._sample(seq, row_logits)))

    def _decode_rows_alone(self) -> None:
        """After a failed batched call: roll every row back to its committed tokens (the call committed nothing; the
        blocks it took for the new tokens go back) and decode each row in its own call, failing only those that
        fail alone."""
        for seq in self.running:
            self.cache.crop_sequence(seq.kv, seq.kv.length)
        for seq in list(self.running):
            def one(seq=seq):
                logits = self._forward([seq], [[seq.generated[-1]]])
                self._accept(seq, self._sample(seq, logits[0]))
            self._guarded(seq, one)

    def _guarded(self, seq: Sequence, work) -> None:
        """Run one request's share of a turn; if it raises, that request (only) ends with an error event."""
        try:
            work()
        except Exception as exc:
            log.exception("request %s failed", seq.id)
            self._fail(seq, f"internal error: {type(exc).__name__}: {exc}")

    def _fail(self, seq: Sequence, message: str) -> None:
        """End `seq` with an error event whatever state its failure left it in; never raises."""
        try:
            if seq.kv is not None:
                kv, seq.kv = seq.kv, None
                self.cache.free(kv)
        except Exception:
            log.exception("freeing the blocks of request %s failed", seq.id)
        if seq in self.running:
            self.running.remove(seq)
        if seq.finish_reason is None:  # (one that failed while finishing is counted already)
            self.metrics.finished.labels("error").inc()
        seq.finish_reason = "error"
        try:
            seq.emit({"type": "error", "message": message})
        except Exception:
            log.exception("request %s: its error event could not be sent", seq.id)

    def _speculate(self) -> bool:
        """One draft-and-verify round for the whole running batch; False (nothing done) when no row drafted a token
        or the verify pass does not fit in the pool (the caller then runs a plain decode step)."""
        seqs = list(self.running)
        drafts = [self._draft(seq) for seq in seqs]
        width = max(len(d) for d in drafts)
        if width == 0:
            return False
        rows = [[s.generated[-1]] + d + [s.generated[-1]] * (width - len(d)) for s, d in zip(seqs, drafts)]
        lengths = [s.kv.length for s in seqs]
        try:
            logits = self._forward(seqs, rows, keep=width + 1)
        except OutOfBlocks:  # the failed bind gave back what it took (PagedKVCache.bind)
            return False
        except Exception:  # roll back what the call took (it committed nothing): a plain, row-isolated step instead
            log.exception("verify pass failed; running a plain decode step")
            for seq in seqs:
                self.cache.crop_sequence(seq.kv, seq.kv.length)
            return False
        self.spec_rounds += 1
        for seq, drafted, row_logits, length in zip(seqs, drafts, logits, lengths):
            self._guarded(seq, lambda seq=seq, drafted=drafted, row_logits=row_logits, length=length:
                          self._keep_verified(seq, drafted, row_logits, length))
        return True

    def _keep_verified(self, seq: Sequence, drafted: list[int], row_logits: torch.Tensor, length: int) -> None:
        """One row of a verify pass: its kept draft prefix and the target's next token, the rest cropped away."""
        if drafted:
            verdict = verify_row(row_logits, drafted, seq.sampling, seq.generator)
            tokens = verdict.tokens
            seq.spec_proposed += verdict.proposed
            seq.spec_accepted += verdict.accepted
            self.spec_proposed += verdict.proposed
            self.spec_accepted += verdict.accepted
            seq.spec_k = self.spec.length.next(seq.spec_k or self.spec.length.k, verdict.accepted == len(drafted))
        else:  # exactly a decode step for this row
            tokens = [self._sample(seq, row_logits[0])]
        # keep its last token and the accepted draft; the rejected tail and the padding are dropped
        self.cache.crop_sequence(seq.kv, length + len(tokens))
        for token in tokens:
            self._accept(seq, token)
            if seq.done:  # a stop token/string or max_tokens mid-run: nothing after it is emitted
                break

    def _draft(self, seq: Sequence) -> list[int]:
        # never past max_tokens: a round emits the accepted drafts plus one token of the target's own
        k = min(seq.spec_k or self.spec.length.k, seq.max_tokens - len(seq.generated) - 1)
        try:
            return self.spec.draft.lookup(seq.context_ids, k) if k > 0 else []
        except Exception:  # a draft is only a guess: this row decodes plainly this turn
            log.exception("drafting for request %s failed", seq.id)
            return []

    def _forward(self, seqs: list[Sequence], new_tokens: list[list[int]], keep: int = 1) -> torch.Tensor:
        """One model call adding `new_tokens` to `seqs` (toolkit.engine.generate.paged_forward)."""
        return paged_forward(self.model, self.cache, [s.kv for s in seqs], new_tokens, keep)

    def _preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and put it back at the head of the queue, to be recomputed from prompt + generated."""
        seq.preemptions += 1
        self.preemptions += 1
        self.metrics.preemptions.inc()
        self._requeue(seq)

    def _requeue(self, seq: Sequence) -> None:
        self.cache.free(seq.kv)
        seq.kv = None
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
        if seq in self.running:  # (a waiting sequence ended by abort_all never ran)
            self.running.remove(seq)
        seq.finish_reason = reason
        self.metrics.finished.labels(reason).inc()
        if reason in ("cancelled",):
            return
        if error is not None:
            seq.emit({"type": "error", "message": error})
            return
        text = ""
        if seq.detok is not None:
            rest = seq.detok.push(seq.generated, final=True)
            if rest:
                seq.emit({"type": "token", "text": rest})
            text = seq.detok.text
        seq.emit({"type": "done", "text": text, "finish_reason": reason, "usage": seq.usage(),
                  "timings": seq.timings(), "token_ids": list(seq.generated)})

    def _publish(self) -> None:
        m = self.metrics
        m.batch.set(len(self.running))
        m.queue.set(len(self.waiting))
        m.kv_bytes.set(self.cache.nbytes)
        m.kv_tokens.set(sum(s.kv.length for s in self.running if s.kv is not None))
        m.publish_pool(self.cache.pool)
        if self.spec_proposed:
            m.acceptance.set(self.spec_accepted / self.spec_proposed)
        self.peak_blocks_used = max(self.peak_blocks_used, self.cache.pool.used)


