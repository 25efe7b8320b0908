"""The HTTP face of the server (FastAPI): OpenAI-compatible routes over a `Scheduler`.

Handlers never touch the model: they parse and check the request (protocol.py), hand a `Sequence` to the scheduler,
and relay its events (from the scheduler thread, via call_soon_threadsafe) either as one JSON response or as
server-sent events in OpenAI's chunk format ending with `data: [DONE]`. A client that goes away cancels its sequence,
which frees its KV blocks at the scheduler's next turn.
"""

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from toolkit.serve.metrics import ServerMetrics
from toolkit.serve.protocol import APIError, parse_chat, parse_completion
from toolkit.serve.scheduler import QueueFull, Scheduler
from toolkit.serve.sequence import Sequence

_DISCONNECT_POLL_S = 0.5
_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}


@dataclass
class ServerState:
    scheduler: Scheduler
    tokenizer: object
    model_id: str  # the name clients put in "model"
    max_tokens_limit: int
    api_key: str | None
    metrics: ServerMetrics
    created: int


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="specquant", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, str(exc.detail), kind).body(), status_code=exc.status_code)

    app.add_middleware(_CountRequests, metrics=state.metrics)

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
        return {"status": "ok", "model": state.model_id, "running": len(s.running), "waiting": len(s.waiting)}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": state.created,
                                            "owned_by": "specquant"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, chat=True)

    async def _generate(request: Request, chat: bool):
        authorize(request)
        body = await _json_body(request)
        model = body.get("model")
        if not isinstance(model, str):
            raise APIError(400, "model is required", param="model", code="invalid_type")
        if model != state.model_id:
            raise APIError(404, f"the model {model!r} does not exist on this server; it serves {state.model_id!r}",
                           param="model", code="model_not_found")
        parse = parse_chat if chat else parse_completion
        parsed = parse(body, state.tokenizer, state.max_tokens_limit, state.scheduler.limits.max_seq_len)
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
        try:
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), _DISCONNECT_POLL_S)
                except asyncio.TimeoutError:  # (a distinct class before Python 3.11)
                    if await request.is_disconnected():
                        _cancel(seq)
                        return JSONResponse({}, status_code=499)
                    continue
                if event["type"] == "error":
                    raise APIError(500, event["message"], type="server_error", code="internal_error")
                if event["type"] == "done":
                    return _full_response(event, chat, meta)
        except asyncio.CancelledError:
            _cancel(seq)
            raise

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


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json")
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


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
