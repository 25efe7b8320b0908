"""The HTTP face of the server (FastAPI): OpenAI-compatible routes over a `Scheduler`.

Handlers never touch the model: they parse and check the request (protocol.py), hand a `Sequence` to the scheduler,
and relay its events (from the scheduler thread, via call_soon_threadsafe) either as one JSON response or as
server-sent events in OpenAI's chunk format ending with `data: [DONE]`. A client that goes away cancels its sequence,
which frees its KV blocks at the scheduler's next turn: a stream notices when its connection closes, a non-streaming
request has a task listening for the disconnect message while it waits.

Every error is an OpenAI-style JSON body ({"error": {"message", "type", "param", "code"}}) with a 4xx/5xx status, the
connection kept open: bad JSON, too deep a nesting or a lone surrogate (400, before any field is looked at), a body
over max_body_bytes (413, from Content-Length before reading, or counted while reading), a POST body that is not
application/json (415: a browser's cross-origin "simple" text/plain request is refused), a server that is draining
(503), and any unexpected exception (500, from the outermost middleware, `_Guard`). JSON decoding, tokenization and
chat-template rendering run on a worker thread, never on the event loop.
"""

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from toolkit.serve.metrics import ServerMetrics
from toolkit.serve.protocol import APIError, parse_chat, parse_completion
from toolkit.serve.scheduler import QueueFull, Scheduler
from toolkit.serve.sequence import Sequence

log = logging.getLogger(__name__)

_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}
MAX_BODY_BYTES = 4 * 2**20  # default request body limit (conf/serve.yaml max_body_mb)
MAX_JSON_DEPTH = 32  # deeper bodies are refused (no field this server reads nests more than 4 deep)


@dataclass
class ServerState:
    scheduler: Scheduler
    tokenizer: object
    model_id: str  # the name clients put in "model"
    max_tokens_limit: int
    api_key: str | None
    metrics: ServerMetrics
    created: int
    max_body_bytes: int = MAX_BODY_BYTES  # larger request bodies: 413
    drain_timeout_s: float = 30.0  # graceful shutdown: how long running requests may go on (server.drain)
    draining: bool = False  # set by server.drain: new requests get 503


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="specquant", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    try:  # a fast tokenizer's first call resets its padding/truncation state (a mutation): do it now, before
        state.tokenizer("warm-up")  # worker threads tokenize concurrently ("Already borrowed" otherwise)
    except Exception:
        log.debug("tokenizer warm-up failed", exc_info=True)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, str(exc.detail), kind).body(), status_code=exc.status_code)

    app.add_middleware(_Guard, max_body_bytes=state.max_body_bytes)
    app.add_middleware(_CountRequests, metrics=state.metrics)  # added last: the outermost (counts _Guard's answers)

    def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                           code="invalid_api_key")

    @app.get("/health")
    async def health():
        s = state.scheduler
        return {"status": "draining" if state.draining else "ok", "model": state.model_id,
                "running": len(s.running), "waiting": len(s.waiting), "kv_blocks_free": s.cache.pool.available,
                "kv_blocks_total": s.cache.pool.num_blocks}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "specquant"}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        authorize(request)
        if model_id != state.model_id:
            raise APIError(404, f"the model {_clip(model_id)!r} does not exist on this server; it serves "
                           f"{state.model_id!r}", type="not_found_error", param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, chat=True)

    async def _generate(request: Request, chat: bool):
        authorize(request)
        if state.draining:
            raise APIError(503, "the server is shutting down; retry on another instance", type="server_error",
                           code="server_shutting_down", headers={"Retry-After": "1"})
        body = await _json_body(request)
        model = body.get("model")
        if not isinstance(model, str):
            raise APIError(400, "model is required", param="model", code="invalid_type")
        if model != state.model_id:
            raise APIError(404, f"the model {_clip(model)!r} does not exist on this server; it serves {state.model_id!r}",
                           param="model", code="model_not_found")
        parse = parse_chat if chat else parse_completion
        # tokenization and the chat template are CPU work: a worker thread, never the event loop
        parsed = await anyio.to_thread.run_sync(parse, body, state.tokenizer, state.max_tokens_limit,
                                                state.scheduler.limits.max_seq_len)
        if state.draining:  # it began draining while this one was tokenized
            raise APIError(503, "the server is shutting down; retry on another instance", type="server_error",
                           code="server_shutting_down", headers={"Retry-After": "1"})
        scheduler = state.scheduler
        if not scheduler.fits(len(parsed.prompt_ids) + parsed.max_tokens):  # it would never fit, even alone
            raise APIError(400, f"prompt + max_tokens ({len(parsed.prompt_ids) + parsed.max_tokens} tokens) exceeds "
                           f"this server's whole KV pool of {scheduler.kv_capacity_tokens} tokens "
                           f"({scheduler.cache.pool.num_blocks} blocks of {scheduler.cache.block_size})",
                           param="max_tokens", code="context_length_exceeded")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event: dict) -> None:  # called on the scheduler thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop has closed (shutdown): nobody is listening
                pass

        seq = Sequence(parsed.prompt_ids, parsed.max_tokens, parsed.sampling, parsed.stop, emit)
        try:
            state.scheduler.submit(seq)
        except QueueFull as full:
            raise APIError(429, "the server is at capacity (queue full); retry later", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(full.retry_after)})
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": state.model_id}
        if parsed.stream:
            return StreamingResponse(_sse(seq, events, chat, meta, parsed.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _collect(request, seq, events, chat, meta)

    def _cancel(seq: Sequence) -> None:
        seq.cancel()
        state.scheduler.wake()

    async def _collect(request: Request, seq: Sequence, events: asyncio.Queue, chat: bool, meta: dict):
        async def watch() -> None:  # the body is read: the next message is http.disconnect, when the client leaves
            try:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
            except Exception:  # the server's receive() failed: treat it as the client gone
                log.debug("receive() failed while waiting for a disconnect", exc_info=True)
            events.put_nowait({"type": "disconnect"})

        watcher = asyncio.ensure_future(watch())
        try:
            while True:
                event = await events.get()
                if event["type"] == "disconnect":  # cancelled at the scheduler's next turn; nobody reads this
                    _cancel(seq)
                    return JSONResponse(APIError(499, "the client closed the connection", code="client_closed")
                                        .body(), status_code=499)
                if event["type"] == "error":
                    raise APIError(500, event["message"], type="server_error", code="internal_error")
                if event["type"] == "done":
                    return _full_response(event, chat, meta)
        except asyncio.CancelledError:
            _cancel(seq)
            raise
        finally:
            watcher.cancel()

    async def _sse(seq: Sequence, events: asyncio.Queue, chat: bool, meta: dict, include_usage: bool):
        finished = False
        try:
            if chat:
                yield _event(_chunk(meta, chat, {"role": "assistant", "content": ""}, None))
            while True:
                event = await events.get()
                if event["type"] == "token":
                    delta = {"content": event["text"]} if chat else event["text"]
                    yield _event(_chunk(meta, chat, delta, None))
                elif event["type"] == "done":
                    last = _chunk(meta, chat, {} if chat else "", event["finish_reason"])
                    last["timings"] = event["timings"]
                    if not include_usage:  # clients that did not ask still find the counts on the last chunk
                        last["usage"] = event["usage"]
                    yield _event(last)
                    if include_usage:
                        yield _event({**_chunk(meta, chat, None, None), "choices": [], "usage": event["usage"],
                                      "timings": event["timings"]})
                    break
                else:
                    yield _event(APIError(500, event["message"], "server_error", code="internal_error").body())
                    break
            finished = True
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away mid-stream (starlette cancels this generator)
                _cancel(seq)

    return app


class _CountRequests:
    """Counts responses by path and status. Plain ASGI rather than @app.middleware("http"): that wrapper re-pipes
    streaming bodies and gets in the way of the client-disconnect signal a stream needs."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                path = scope["path"] if scope["path"] in _ROUTES else "other"  # bounded label values
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


class _Guard:
    """The outermost guard (plain ASGI, like _CountRequests): the body-size limit and the last-resort JSON 500.

    The body is read here, whole, before any route runs: a Content-Length over `max_body_bytes` is answered 413 without
    reading a byte of it, and a body without one (chunked) is counted as it arrives and refused as soon as it passes
    the limit. The route then reads the buffered copy; later receive() calls (the disconnect) go to the connection.
    An exception escaping a route before its response started becomes a JSON 500 here (logged), so the client gets
    an OpenAI-style body and the keep-alive connection stays usable; one raised mid-stream can only end the stream."""

    def __init__(self, app, max_body_bytes: int = MAX_BODY_BYTES):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            replay = await self._read_body(scope, receive, tracking_send)
            if replay is not None:
                await self.app(scope, replay, tracking_send)
        except Exception:
            if started:
                raise
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            await _send_json(send, 500, APIError(500, "internal server error", "server_error",
                                                 code="internal_error").body())

    async def _read_body(self, scope, receive, send):
        """A receive() that replays the whole body; None when the request was answered (413) or the client left."""
        limit = self.max_body_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                declared = int(declared)
            except ValueError:
                await _send_json(send, 400, APIError(400, "invalid Content-Length", code="invalid_request").body(),
                                 close=True)
                return None
            if declared > limit:
                if dict(scope.get("headers") or []).get(b"expect", b"").lower() != b"100-continue":
                    await _drain(receive)  # a client still uploading would miss the answer (a reset) otherwise
                await _too_large(send, limit)
                return None
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None  # gone before its request was complete: nothing to answer
            body = message.get("body", b"")
            total += len(body)
            if total > limit:
                if message.get("more_body", False):
                    await _drain(receive)
                await _too_large(send, limit)
                return None
            chunks.append(body)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay


DRAIN_BYTES, DRAIN_SECONDS = 256 * 2**20, 1.0


async def _drain(receive) -> None:
    """Read and drop what is left of a refused body, up to DRAIN_BYTES or DRAIN_SECONDS: closing a connection with
    unread data makes the kernel reset it, and a client still uploading would get the reset instead of the 413 (what
    nginx's lingering close avoids). Nothing is kept, so memory does not grow."""
    loop = asyncio.get_running_loop()
    deadline, seen = loop.time() + DRAIN_SECONDS, 0
    while seen < DRAIN_BYTES:
        left = deadline - loop.time()
        if left <= 0:
            return
        try:
            message = await asyncio.wait_for(receive(), timeout=left)
        except asyncio.TimeoutError:
            return
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return
        seen += len(message.get("body", b""))


async def _too_large(send, limit: int) -> None:
    await _send_json(send, 413, APIError(413, f"the request body exceeds this server's limit of {limit} bytes "
                                         "(max_body_mb)", code="request_too_large").body(), close=True)


async def _send_json(send, status: int, payload: dict, close: bool = False) -> None:
    """A whole JSON response from ASGI middleware; `close`: ask for the connection to close (unread body left)."""
    data = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


async def _json_body(request: Request) -> dict:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"the request body must be JSON sent as Content-Type: application/json, got "
                       f"{_clip(media_type or 'no Content-Type')!r}", code="unsupported_media_type")
    raw = await request.body()
    return await anyio.to_thread.run_sync(_decode_json, raw)  # megabytes of JSON: not on the event loop


def _decode_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json")
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, and ints of more than 4300 digits
        raise APIError(400, f"the request body is not valid JSON: {_clip(str(exc))}", code="invalid_json")
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    _check_values(body)
    return body


def _check_values(body: dict) -> None:
    """Every string must be encodable text (a lone surrogate such as "\ud800" is valid JSON but no text a tokenizer
    or a response can carry), and nothing nests deeper than MAX_JSON_DEPTH; a 400 naming where, otherwise."""
    stack = [(value, (key,), 1) for key, value in body.items()]
    for key in body:
        _check_text(key, ())
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise APIError(400, f"the request body nests more than {MAX_JSON_DEPTH} levels deep",
                               param=_param(path), code="invalid_json")
            if isinstance(value, dict):
                for key, item in value.items():
                    _check_text(key, path)
                    if isinstance(item, (str, dict, list)):
                        stack.append((item, path + (key,), depth + 1))
            else:
                for i, item in enumerate(value):
                    if isinstance(item, (str, dict, list)):
                        stack.append((item, path + (i,), depth + 1))


def _check_text(text: str, path: tuple) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "the request contains a string that is not valid Unicode text (a lone surrogate)",
                       param=_param(path), code="invalid_value")


def _param(path: tuple) -> str | None:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return _clip(out.encode("utf-8", "backslashreplace").decode()) or None


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _chunk(meta: dict, chat: bool, delta, finish_reason) -> dict:
    choice = {"index": 0, "finish_reason": finish_reason}
    if chat:
        choice["delta"] = delta if delta is not None else {}
        choice["logprobs"] = None
    else:
        choice["text"] = delta if delta is not None else ""
        choice["logprobs"] = None
    return {**meta, "object": "chat.completion.chunk" if chat else "text_completion", "choices": [choice]}


def _full_response(event: dict, chat: bool, meta: dict) -> JSONResponse:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": event["text"]},
                  "finish_reason": event["finish_reason"], "logprobs": None}
    else:
        choice = {"index": 0, "text": event["text"], "finish_reason": event["finish_reason"], "logprobs": None}
    return JSONResponse({**meta, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                         "usage": event["usage"], "timings": event["timings"]})


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
