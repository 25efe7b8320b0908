"""One request as the scheduler sees it: its prompt and sampling settings, what it generated, when, and where its
events go. Events are handed to `emit` (set by the HTTP layer; thread-safe) as dicts:
    {"type": "token", "text": delta}                         text that can no longer change
    {"type": "done", "text", "finish_reason", "usage", "timings"}
    {"type": "error", "message"}                             the request failed inside the scheduler
"""

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from toolkit.engine.generate import Detokenizer
from toolkit.engine.sampling import SamplingParams
from toolkit.kv.paged import PagedSequence

_ids = itertools.count(1)


@dataclass
class Sequence:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_strings: list[str]
    emit: Callable[[dict], None]
    id: int = field(default_factory=lambda: next(_ids))
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    generated: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    admitted: float | None = None  # first admission (a preempted sequence is admitted again later)
    finish_reason: str | None = None
    kv: PagedSequence | None = None  # its blocks in the pool while it runs; None while it waits
    preemptions: int = 0
    spec_proposed: int = 0  # speculative decoding: tokens drafted for it, and how many of them the target kept
    spec_accepted: int = 0
    spec_k: int | None = None  # its current draft length (adaptive drafts); None = the configured k

    def __post_init__(self):
        # a per-request generator: a seeded request samples the same tokens whatever else shares its batch
        self.generator: torch.Generator | None = self.sampling.generator()
        self.detok: Detokenizer | None = None

    @property
    def context_ids(self) -> list[int]:
        """What a (re)admission prefills: the prompt, plus what it generated before it was preempted."""
        return self.prompt_ids + self.generated

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        self.cancelled.set()

    def timings(self) -> dict:
        gaps = [b - a for a, b in zip(self.token_times, self.token_times[1:])]
        first = self.token_times[0] if self.token_times else None
        return {
            "queue_ms": None if self.admitted is None else (self.admitted - self.arrived) * 1e3,
            "ttft_ms": None if first is None else (first - self.arrived) * 1e3,
            "itl_mean_ms": sum(gaps) / len(gaps) * 1e3 if gaps else None,
            # share of drafted tokens kept; None when nothing was drafted for it (spec=none, or no n-gram matched)
            "acceptance_rate": self.spec_accepted / self.spec_proposed if self.spec_proposed else None,
        }

    def usage(self) -> dict:
        prompt, completion = len(self.prompt_ids), len(self.generated)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
