"""Latency bookkeeping: time to first token, every inter-token latency, percentiles, peak memory."""

import resource
import threading
import time
from dataclasses import asdict, dataclass, field

import psutil


def percentiles(values: list[float], qs=(50, 90, 99)) -> dict[str, float]:
    """Linear-interpolated percentiles (numpy's default method), keyed 'p50', 'p90', ..."""
    if not values:
        return {f"p{q}": float("nan") for q in qs}
    ordered = sorted(values)
    out = {}
    for q in qs:
        pos = (len(ordered) - 1) * q / 100
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        out[f"p{q}"] = ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
    return out


def median_call_us(f, reps: int = 200, warmup: int = 10) -> float:
    """Median microseconds of one call of `f` over `reps` timed calls, after `warmup` untimed ones (kernel tables)."""
    for _ in range(warmup):
        f()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e6


@dataclass
class GenerationTiming:
    """One generation call. `itl_s` has one entry per decode step: new_tokens - 1 of them."""

    prompt_tokens: int  # per sequence, padded batch length for batches
    batch_size: int
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return len(self.itl_s) + 1 if self.ttft_s else 0

    @property
    def decode_s(self) -> float:
        return sum(self.itl_s)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced by decode steps per second, summed over the batch (prefill's token excluded)."""
        return len(self.itl_s) * self.batch_size / self.decode_s if self.itl_s else float("nan")

    def summary(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "batch_size": self.batch_size,
            "ttft_ms": self.ttft_s * 1e3,
            "itl_ms": {k: v * 1e3 for k, v in percentiles(self.itl_s).items()},
            "decode_tokens_per_s": self.decode_tokens_per_s,
        }

    def to_dict(self) -> dict:
        return asdict(self)


class Stopwatch:
    """Marks a sequence of events (prompt in, each token out) and turns them into TTFT and ITLs."""

    def __init__(self):
        self.start = time.perf_counter()
        self.marks: list[float] = []

    def mark(self) -> None:
        self.marks.append(time.perf_counter())

    def timing(self, prompt_tokens: int, batch_size: int) -> GenerationTiming:
        if not self.marks:
            return GenerationTiming(prompt_tokens, batch_size)
        ttft = self.marks[0] - self.start
        itl = [b - a for a, b in zip(self.marks, self.marks[1:])]
        return GenerationTiming(prompt_tokens, batch_size, ttft, itl)


def process_peak_rss_mb() -> float:
    """The process's high-water resident set since it started (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class RssSampler:
    """Peak resident memory while a block runs, sampled by a background thread (ru_maxrss only ever rises,
    so it cannot tell two phases of one process apart)."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._process = psutil.Process()

    def _run(self):
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)
            self._stop.wait(self.interval_s)

    def __enter__(self):
        self.peak_bytes = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)

    @property
    def peak_mb(self) -> float:
        return self.peak_bytes / 2**20
