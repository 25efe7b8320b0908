"""Assemble a server from a loaded model and run it with uvicorn: in the foreground (the CLI) or on a background
thread (tests and the load benchmark, which talk to it over loopback).

Graceful shutdown (`drain`, run on the first SIGTERM/SIGINT in the foreground): new requests get 503, running ones
may finish for up to drain_timeout_s, then whatever is left ends with finish_reason "abort" (a stream gets its final
chunk and `data: [DONE]`), and only then does uvicorn stop. A second signal stops at once."""

import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn

from toolkit.engine.generate import context_length, stop_token_ids
from toolkit.errors import InputError
from toolkit.kv import KVSpec, kv_spec
from toolkit.kv.paged import PagedKVCache
from toolkit.serve.app import ServerState, create_app
from toolkit.serve.metrics import ServerMetrics
from toolkit.serve.scheduler import Limits, Scheduler
from toolkit.serve.speculation import serve_spec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_id: str | None = None  # the name clients send; None = the loaded model's name
    max_batch: int = 16
    max_queue: int = 64
    max_kv_tokens: int = 32768  # the KV block pool in tokens (rounded up to whole blocks), unless kv_budget_mb
    max_seq_len: int | None = None  # None = min(model context, 4096)
    max_tokens: int = 1024  # the largest max_tokens a request may ask for
    kv_budget_mb: float | None = None  # the KV block pool in MiB; when set, it sizes the pool instead
    block_size: int = 16  # tokens per KV block
    prefix_cache: bool = True  # reuse cached prompt-prefix blocks
    kv: KVSpec = field(default_factory=KVSpec)  # KVSpec.from_node of the kv group: int8/int4/int2 quantize blocks
    spec: object = None  # the spec config group (node or kind name; None = none): lookup is served
    spec_max_batch: int = 4  # speculate only while the running batch has at most this many rows
    max_body_mb: float = 4.0  # request bodies over this many MiB: 413
    drain_timeout_s: float = 30.0  # graceful shutdown: how long running requests may finish before they are aborted


def build_state(loaded, settings: ServeSettings) -> ServerState:
    model = loaded.model
    context = context_length(model)
    max_seq_len = settings.max_seq_len or min(context, 4096)
    for name, value in (("max_batch", settings.max_batch), ("max_queue", settings.max_queue),
                        ("max_kv_tokens", settings.max_kv_tokens), ("max_seq_len", max_seq_len),
                        ("max_tokens", settings.max_tokens), ("block_size", settings.block_size)):
        if value < 1:
            raise InputError(f"{name} must be >= 1, got {value}", f"set {name}= to a positive number")
    spec = serve_spec(settings.spec, settings.spec_max_batch)
    if settings.kv_budget_mb is not None and not kv_spec(settings.kv).quantized:  # quantized: plan_pool says why not
        per_block = PagedKVCache.bytes_per_block(model, settings.block_size)
        if settings.kv_budget_mb * 2**20 < per_block:
            raise InputError(f"kv_budget_mb={settings.kv_budget_mb} holds no KV block: one block of "
                             f"{settings.block_size} tokens takes {per_block / 2**20:.3g} MiB for this model",
                             "raise kv_budget_mb, or set it to null to size the pool by max_kv_tokens")
    if not settings.max_body_mb > 0:
        raise InputError(f"max_body_mb must be > 0, got {settings.max_body_mb}", "set max_body_mb=4")
    if not settings.drain_timeout_s >= 0:
        raise InputError(f"drain_timeout_s must be >= 0, got {settings.drain_timeout_s}", "set drain_timeout_s=30")
    if max_seq_len > context:
        raise InputError(f"max_seq_len={max_seq_len} exceeds the model's context of {context} tokens",
                         f"use max_seq_len<={context} or null")
    limits = Limits(settings.max_batch, settings.max_queue, settings.max_kv_tokens, max_seq_len, settings.block_size,
                    settings.prefix_cache, settings.kv_budget_mb, settings.kv)
    metrics = ServerMetrics()
    scheduler = Scheduler(model, loaded.tokenizer, stop_token_ids(model, loaded.tokenizer), limits, metrics, spec)
    return ServerState(scheduler, loaded.tokenizer, settings.model_id or str(loaded.name), settings.max_tokens,
                       settings.api_key, metrics, int(time.time()), max_body_bytes=int(settings.max_body_mb * 2**20),
                       drain_timeout_s=float(settings.drain_timeout_s))


def drain(state: ServerState, timeout_s: float | None = None, poll_s: float = 0.02, settle_s: float = 10.0) -> int:
    """Graceful shutdown's first half: refuse new requests (503), let the running and queued ones finish for up to
    `timeout_s` (default state.drain_timeout_s), then end the rest with finish_reason "abort"; returns how many were
    aborted. Every wait is bounded. Call it on any thread but the scheduler's (the CLI: on a signal)."""
    state.draining = True
    scheduler = state.scheduler
    deadline = time.monotonic() + (state.drain_timeout_s if timeout_s is None else timeout_s)
    while not scheduler.idle and time.monotonic() < deadline:
        time.sleep(poll_s)
    left = len(scheduler.running) + len(scheduler.waiting)
    if left:
        log.warning("drain timeout: aborting %d request(s)", left)
        scheduler.abort_all()
        deadline = time.monotonic() + settle_s
        while not scheduler.idle and time.monotonic() < deadline:
            time.sleep(poll_s)
    return left


class DrainingServer(uvicorn.Server):
    """uvicorn that drains (`drain`) on the first SIGTERM/SIGINT before it stops; a second signal stops at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state, self.drainer = state, None

    def handle_exit(self, sig, frame) -> None:
        if self.drainer is not None or sig not in (signal.SIGTERM, signal.SIGINT):
            return super().handle_exit(sig, frame)
        self._captured_signals.append(sig)  # (uvicorn re-raises it once stopped, as for its own handling)

        def run():
            try:
                drain(self.state)
            finally:
                self.should_exit = True

        self.drainer = threading.Thread(target=run, name="specquant-drain", daemon=True)
        self.drainer.start()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BackgroundServer:
    """uvicorn on a daemon thread; `url` once started. Use as a context manager."""

    def __init__(self, state: ServerState, host: str = "127.0.0.1", port: int | None = None):
        self.state = state
        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(create_app(state), host=self.host, port=self.port, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=2)
        self.server = DrainingServer(config, state)  # (signals are only caught on the main thread; tests call
        # self.server.handle_exit to drain as a signal would)
        self.thread = threading.Thread(target=self.server.run, name="specquant-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "BackgroundServer":
        self.state.scheduler.start()
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.state.scheduler.stop()


def serve_forever(state: ServerState, host: str, port: int) -> None:
    state.scheduler.start()
    try:
        config = uvicorn.Config(create_app(state), host=host, port=port, log_level="info", lifespan="off",
                                timeout_graceful_shutdown=5)
        server = DrainingServer(config, state)
        server.run()
        if not server.started:  # as uvicorn.run does: the port was taken, say
            raise SystemExit(3)
    finally:
        state.scheduler.stop()
