"""Acceptance measurements for the hardened `specquant serve` (docs/serving.md, "Guarantees").

Starts `specquant serve` (the default model) as a subprocess on a free 127.0.0.1 port, waits for /health, runs four
phases against it over loopback, stops it, prints a summary and writes the figures as JSON to --out:

1. fuzz:    >= --fuzz-requests fuzzed bodies to /v1/completions and /v1/chat/completions while 4 greedy streams loop
            beside them; no 5xx, every error a JSON body, every greedy stream equal to its solo output, no batch
            crash (/metrics error counters, the server log).
2. orphans: --orphans non-streaming requests (max_tokens=300) whose clients give up after --orphan-timeout s; how many
            generations still run 2 s later, and the KV pool once everything is gone.
3. bigbody: a --big-mb MB body to /v1/completions (declared Content-Length, then chunked): time to the 413, server RSS
            before/after, /health latency measured while the upload runs.
4. soak:    --soak-clients clients for --soak-seconds mixing streams, non-streams, mid-stream disconnects and bad
            requests; unexpected errors, RSS after the warm-up and at the end, KV pool all free at the end.

Every loop is bounded in count and time. Example (a short run):
    python benchmarks/serve_hardening.py --fuzz-requests 300 --orphans 8 --big-mb 10 --soak-seconds 60 --out /tmp/h.json
"""

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

import httpx
import psutil

HOST = "127.0.0.1"
MODEL = "smollm2-135m"

# the four greedy streams of the fuzz phase: two completions, two chats
GREEDY = [
    ("/v1/completions", {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 64, "temperature": 0,
                         "stream": True}),
    ("/v1/completions", {"model": MODEL, "prompt": "def fibonacci(n):\n", "max_tokens": 64, "temperature": 0,
                         "stream": True}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Write a haiku about rain."}],
                              "max_tokens": 64, "temperature": 0, "stream": True}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "system", "content": "You are terse."},
                                                           {"role": "user", "content": "List three prime numbers."}],
                              "max_tokens": 64, "temperature": 0, "stream": True}),
]


# ----------------------------------------------------------------------------------------------------------- server

def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, log_path: str, extra: list[str]):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")
        env = dict(os.environ, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))
        self.proc = subprocess.Popen(["specquant", "serve", f"host={HOST}", f"port={self.port}", *extra],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.ps = psutil.Process(self.proc.pid)

    def wait_ready(self, timeout_s: float = 180.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready in {timeout_s} s; see {self.log_path}")

    def rss_mb(self) -> float:
        return self.ps.memory_info().rss / 2**20

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # graceful (drains: nothing should be running by now)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
        return self.proc.returncode

    def log_findings(self) -> dict:
        text = open(self.log_path, "rb").read().decode("utf-8", "replace")
        return {"tracebacks": text.count("Traceback"),
                "batched_step_failures": text.count("batched decode step failed"),
                "error_lines": sum(1 for line in text.splitlines() if line.startswith("ERROR")),
                "unhandled_error_lines": text.count("unhandled error in")}


async def health(client: httpx.AsyncClient, url: str) -> dict:
    r = await client.get(url + "/health", timeout=10)
    return r.json()


async def metrics(client: httpx.AsyncClient, url: str) -> dict:
    """The counters that would show a crash: requests by status class, sequences finished by reason."""
    text = (await client.get(url + "/metrics", timeout=10)).text
    out = {"requests_5xx": 0.0, "requests_total": 0.0, "finished": {}, "preemptions": 0.0}
    for line in text.splitlines():
        m = re.match(r'specquant_requests_total\{endpoint="([^"]*)",status="(\d+)"\} (\S+)', line)
        if m:
            out["requests_total"] += float(m.group(3))
            if m.group(2).startswith("5"):
                out["requests_5xx"] += float(m.group(3))
        m = re.match(r'specquant_sequences_finished_total\{reason="([^"]*)"\} (\S+)', line)
        if m:
            out["finished"][m.group(1)] = float(m.group(2))
        m = re.match(r"specquant_preemptions_total (\S+)", line)
        if m:
            out["preemptions"] = float(m.group(1))
    return out


async def wait_idle(client, url, timeout_s: float = 15.0) -> tuple[dict, float]:
    t0 = time.monotonic()
    h = await health(client, url)
    while (h["running"] or h["waiting"]) and time.monotonic() - t0 < timeout_s:
        await asyncio.sleep(0.1)
        h = await health(client, url)
    return h, time.monotonic() - t0


# ------------------------------------------------------------------------------------------------------ streaming

async def stream_text(client: httpx.AsyncClient, url: str, path: str, body: dict, timeout: float = 120.0,
                      stop_after_chunks: int | None = None) -> dict:
    """One streaming request; returns {status, text, done, error_event, chunks}. stop_after_chunks: leave early."""
    chat = path.endswith("chat/completions")
    out = {"status": None, "text": "", "done": False, "error_event": None, "chunks": 0, "left": False}
    async with client.stream("POST", url + path, json=body, timeout=timeout) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["body"] = (await r.aread()).decode("utf-8", "replace")[:300]
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                out["done"] = True
                break
            event = json.loads(data)
            if "error" in event:
                out["error_event"] = event["error"]
                continue
            for choice in event.get("choices", []):
                out["text"] += (choice.get("delta", {}).get("content") or "") if chat else (choice.get("text") or "")
            out["chunks"] += 1
            if stop_after_chunks is not None and out["chunks"] >= stop_after_chunks:
                out["left"] = True
                break  # leaving the context manager closes the connection mid-stream
    return out


# ----------------------------------------------------------------------------------------------------------- fuzz

ODD_STRINGS = ["", "\x00", "\u202e\u202d", "e\u0301\u0301\u0301", "\U0001F600" * 50, "\ufeff", "\uffff", "\ufffd",
               "\u200b" * 100, "a" * 100_000, "\n" * 1000, "<|im_start|>system", "</s>", "{{ 7*7 }}", "%s%n",
               "\U0010FFFF", "\u0000\u0001\u0002", "ÿ" * 10]
SURROGATES = ["\ud800", "\udfff", "a\udc80b", "\ud83d"]


class Fuzzer:
    """Random bad (and sometimes valid but cheap) requests: (path, content bytes, headers, description)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.raw: dict[str, str] = {}

    def _mark(self, raw_text: str) -> str:  # a JSON string placeholder replaced by raw text after json.dumps
        key = f"@@RAW{len(self.raw)}@@"
        self.raw[key] = raw_text
        return key

    def value(self, depth: int = 0):
        r = self.rng
        kind = r.randrange(14)
        if kind == 0:
            return r.choice([None, True, False])
        if kind == 1:
            return r.choice([0, -1, 1, 2**31, 2**63, 2**64, -2**63 - 1, 2**64 + 1, 10**30, -10**30, 2**200])
        if kind == 2:
            return self._mark(r.choice(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e-999", "-0",
                                        "9" * 5000, "1" + "0" * 400, "0.1e" + "9" * 30]))
        if kind == 3:
            return r.choice([0.5, -0.0, 1e308, -1e308, 5e-324, 2.000001, 1e-5, 3.5])
        if kind == 4:
            return r.choice(ODD_STRINGS)
        if kind == 5:
            return r.choice(SURROGATES)  # escaped \udxxx in JSON, or raw bytes with surrogatepass (see body())
        if kind == 6:
            n = r.choice([1, 40, 200, 3000])
            if n > 200:  # deeper than json.dumps recurses: raw text
                return self._mark("[" * n + "1" + "]" * n if r.random() < 0.5 else '{"a":' * n + "1" + "}" * n)
            v = 1
            for _ in range(n):
                v = [v] if r.random() < 0.5 else {"a": v}
            return v
        if kind == 7:
            return [r.randrange(-5, 70000) for _ in range(r.choice([0, 1, 5, 3000]))]
        if kind == 8:
            return {"".join(chr(r.randrange(32, 0x2FFF)) for _ in range(5)): 1 for _ in range(r.choice([1, 50, 5000]))}
        if kind == 9:
            return "".join(chr(r.randrange(1, 0x10FFFF)) for _ in range(r.randrange(1, 200))
                           ).encode("utf-8", "ignore").decode("utf-8", "ignore")
        if kind == 10 and depth < 3:
            return [self.value(depth + 1) for _ in range(r.randrange(4))]
        if kind == 11 and depth < 3:
            return {r.choice(["role", "content", "type", "text", "x"]): self.value(depth + 1) for _ in range(3)}
        if kind == 12:
            return r.choice(["user", "system", "assistant", "tool", "function", "developer", "USER", "", "ü"])
        return r.choice(["hello", 1, 1.5, [], {}, "smollm2-135m"])

    def base(self, chat: bool) -> dict:
        r = self.rng
        body = {"model": MODEL, "max_tokens": r.choice([1, 2, 4, 8]), "temperature": r.choice([0, 0.7, 1.0])}
        if chat:
            body["messages"] = [{"role": "user", "content": "Say hi."}]
        else:
            body["prompt"] = "Hello"
        if r.random() < 0.2:
            body["stream"] = True
        return body

    def body(self) -> tuple[str, bytes, dict, str]:
        r = self.rng
        self.raw = {}
        chat = r.random() < 0.5
        path = "/v1/chat/completions" if chat else "/v1/completions"
        headers = {"Content-Type": "application/json"}
        kind = r.randrange(100)
        path, data, headers, what = self._body(r, chat, path, headers, kind)
        return path, data, [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()], what

    def _body(self, r, chat, path, headers, kind):
        if kind < 8:  # random junk bytes
            return path, bytes(r.randrange(256) for _ in range(r.choice([1, 10, 1000, 50_000]))), headers, "junk"
        if kind < 13:  # truncated / non-object / empty JSON
            text = json.dumps(self.base(chat))
            return path, r.choice([text[: r.randrange(len(text))].encode(), b"[]", b"null", b"1e999", b'"x"', b"",
                                   b"{" * 100_000, b"[" * 100_000 + b"]" * 100_000, b"{}"]), headers, "malformed"
        if kind < 20:  # wrong content type (valid body)
            headers = {"Content-Type": r.choice(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                                 "application/jsonx", "", "application/json; charset=\xff"])}
            if headers["Content-Type"] == "":
                headers = {}
            return path, json.dumps(self.base(chat)).encode(), headers, "content_type"
        if kind < 25:  # other encodings of a valid body
            text = json.dumps(self.base(chat), ensure_ascii=False).replace("Hello", "Héllo ü").replace("Say", "Säy")
            enc = r.choice(["utf-16", "utf-32", "latin-1", "utf-8-sig"])
            return path, text.encode(enc), headers, "encoding"
        body = self.base(chat)
        for _ in range(r.randrange(1, 4)):  # mutate 1-3 fields
            op = r.randrange(10)
            if op < 5:
                key = r.choice(["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
                                "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n", "logprobs",
                                "echo", "logit_bias", "tools", "user", "response_format", "x-extra",
                                "\ud800" if r.random() < 0.1 else "extra"])
                body[key] = self.value()
            elif op < 7 and chat:
                msg = {"role": self.value() if r.random() < 0.5 else r.choice(["user", "system", "assistant"]),
                       "content": self.value() if r.random() < 0.7 else "hi"}
                if r.random() < 0.3:
                    msg[r.choice(["name", "tool_calls", "x"])] = self.value()
                body["messages"] = r.choice([[msg], (body["messages"] if isinstance(body.get("messages"), list) else []) + [msg], msg, [msg] * 50])
            elif op < 8:
                body.pop(r.choice(list(body)), None)
            elif op < 9 and not chat:
                body["prompt"] = r.choice([self.value(), [self.value()], [r.randrange(-2, 60000) for _ in range(8)]])
            else:
                body[r.choice(["temperature", "top_p", "seed", "max_tokens"])] = self.value()
        # keep any accepted request cheap: a valid max_tokens stays tiny (chat's default would be the 1024 limit)
        for key in ("max_tokens", "max_completion_tokens"):
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and 8 < v <= 4096:
                body[key] = r.choice([1, 4, 8])
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = r.choice([1, 4, 8])
        raw_bytes = r.random() < 0.5
        try:
            text = json.dumps(body, ensure_ascii=not raw_bytes, allow_nan=True)
        except (ValueError, RecursionError):  # an int too long for str(): send it raw instead
            text = json.dumps({k: v for k, v in body.items() if not isinstance(v, int)}, ensure_ascii=not raw_bytes)
        for key, raw in self.raw.items():
            text = text.replace(json.dumps(key), raw)
        data = text.encode("utf-8", "surrogatepass")  # raw lone surrogates become (invalid) UTF-8 bytes
        return path, data, headers, "mutated"


def is_json_error(status: int, content: bytes) -> bool:
    try:
        body = json.loads(content)
    except ValueError:
        return False
    return isinstance(body, dict) and isinstance(body.get("error"), dict) and "message" in body["error"]


async def fuzz_phase(url: str, args) -> dict:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        # solo references: each greedy stream alone, nothing else running
        await wait_idle(client, url)
        solo = []
        for path, body in GREEDY:
            out = await stream_text(client, url, path, body)
            assert out["status"] == 200 and out["done"], out
            solo.append(out["text"])
        before = await metrics(client, url)

        stop = asyncio.Event()
        greedy_stats = [{"runs": 0, "mismatches": 0, "missing_done": 0, "errors": 0, "error_samples": []}
                        for _ in GREEDY]

        async def greedy_loop(i: int) -> None:
            path, body = GREEDY[i]
            stats = greedy_stats[i]
            while not stop.is_set():
                try:
                    out = await stream_text(client, url, path, body)
                except httpx.HTTPError as exc:
                    stats["errors"] += 1
                    stats["error_samples"].append(repr(exc)[:200])
                    continue
                stats["runs"] += 1
                if out["status"] != 200 or out["error_event"]:
                    stats["errors"] += 1
                    stats["error_samples"].append(str(out)[:200])
                elif not out["done"]:
                    stats["missing_done"] += 1
                elif out["text"] != solo[i]:
                    stats["mismatches"] += 1
                    stats["error_samples"].append(f"got {out['text'][:80]!r} want {solo[i][:80]!r}")

        fuzzer = Fuzzer(args.seed)
        statuses: Counter = Counter()
        kinds: Counter = Counter()
        five_xx, non_json, conn_errors, samples = 0, 0, Counter(), []
        sent = 0
        lock = asyncio.Lock()
        deadline = time.monotonic() + args.fuzz_max_seconds

        async def fuzz_worker() -> None:
            nonlocal sent, five_xx, non_json
            # each worker its own client too: a server that closes a connection (413, junk) must not starve others
            async with httpx.AsyncClient(timeout=args.fuzz_timeout) as fc:
                while time.monotonic() < deadline:
                    async with lock:
                        if sent >= args.fuzz_requests:
                            return
                        sent += 1
                        path, data, headers, kind = fuzzer.body()
                    kinds[kind] += 1
                    try:
                        r = await fc.post(url + path, content=data, headers=headers)
                        content = r.content
                    except httpx.HTTPError as exc:
                        # a body over max_body_mb is answered 413 and the connection closed with the upload unread:
                        # the kernel then resets it, which can destroy the 413 before the client reads it
                        oversize = len(data) > args.max_body_mb * 2**20
                        conn_errors[("oversize_body_" if oversize else "") + type(exc).__name__] += 1
                        if len(samples) < 10:
                            samples.append(f"{kind}: {type(exc).__name__} {data[:120]!r}")
                        continue
                    statuses[r.status_code] += 1
                    if r.status_code >= 500:
                        five_xx += 1
                        if len(samples) < 10:
                            samples.append(f"{r.status_code} {kind}: {data[:200]!r} -> {content[:200]!r}")
                    elif r.status_code >= 400 and not is_json_error(r.status_code, content):
                        non_json += 1
                        if len(samples) < 10:
                            samples.append(f"non-JSON {r.status_code} {kind}: {content[:200]!r}")

        t0 = time.monotonic()
        greedy = [asyncio.create_task(greedy_loop(i)) for i in range(len(GREEDY))]
        await asyncio.gather(*(fuzz_worker() for _ in range(args.fuzz_concurrency)))
        fuzz_s = time.monotonic() - t0
        stop.set()
        await asyncio.wait_for(asyncio.gather(*greedy), timeout=180)  # each finishes its current stream
        h, _ = await wait_idle(client, url)
        after = await metrics(client, url)
    finished_err = after["finished"].get("error", 0) - before["finished"].get("error", 0)
    res = {
        "fuzz_requests": sent, "fuzz_seconds": round(fuzz_s, 1), "fuzz_concurrency": args.fuzz_concurrency,
        "by_kind": dict(kinds), "status_counts": {str(k): v for k, v in sorted(statuses.items())},
        "five_xx": five_xx, "non_json_error_bodies": non_json, "connection_errors": dict(conn_errors),
        "samples": samples,
        "greedy": [{"path": GREEDY[i][0], "solo_text": solo[i][:120], **s, "error_samples": s["error_samples"][:5]}
                   for i, s in enumerate(greedy_stats)],
        "greedy_runs": sum(s["runs"] for s in greedy_stats),
        "greedy_mismatches": sum(s["mismatches"] for s in greedy_stats),
        "greedy_errors": sum(s["errors"] + s["missing_done"] for s in greedy_stats),
        "metrics_5xx_delta": after["requests_5xx"] - before["requests_5xx"],
        "sequences_finished_error_delta": finished_err,
        "finished_by_reason": after["finished"], "health_after": h,
    }
    res["pass"] = bool(sent >= min(2000, args.fuzz_requests) and five_xx == 0 and non_json == 0
                       and res["greedy_mismatches"] == 0 and res["greedy_errors"] == 0 and finished_err == 0
                       and res["metrics_5xx_delta"] == 0 and res["greedy_runs"] > 0
                       and not any(not k.startswith("oversize_body_") for k in conn_errors))
    return res


# -------------------------------------------------------------------------------------------------------- orphans

async def orphans_phase(url: str, args) -> dict:
    async with httpx.AsyncClient(timeout=10) as client:
        await wait_idle(client, url)
        before = await metrics(client, url)

        async def one(i: int) -> str:
            body = {"model": MODEL, "prompt": f"Story {i}: Once upon a time, in a land far away,", "max_tokens": 300,
                    "temperature": 1.0, "seed": i}
            async with httpx.AsyncClient(timeout=args.orphan_timeout) as c:
                try:
                    r = await c.post(url + "/v1/completions", json=body)
                    return f"completed {r.status_code}"
                except httpx.TimeoutException:
                    return "timeout"
                except httpx.HTTPError as exc:
                    return type(exc).__name__

        t0 = time.monotonic()
        outcomes = Counter(await asyncio.gather(*(one(i) for i in range(args.orphans))))
        gave_up = time.monotonic()
        peak = {"running": 0, "waiting": 0}
        samples = []
        running_at_2s = None
        h = await health(client, url)
        while time.monotonic() - gave_up < args.orphan_wait:
            h = await health(client, url)
            dt = time.monotonic() - gave_up
            samples.append((round(dt, 2), h["running"], h["waiting"]))
            if running_at_2s is None and dt >= 2.0:
                running_at_2s = h["running"] + h["waiting"]
            if dt >= 2.0 and h["running"] == 0 and h["waiting"] == 0:
                break
            await asyncio.sleep(0.05)
        idle_after = next((s[0] for s in samples if s[1] == 0 and s[2] == 0), None)
        after = await metrics(client, url)
    res = {"requests": args.orphans, "client_timeout_s": args.orphan_timeout, "outcomes": dict(outcomes),
           "clients_gave_up_after_s": round(gave_up - t0, 2),
           "running_plus_waiting_2s_after_give_up": running_at_2s,
           "first_idle_s_after_give_up": idle_after,
           "health_samples_first_10": samples[:10],
           "kv_blocks_free_end": h["kv_blocks_free"], "kv_blocks_total": h["kv_blocks_total"],
           "running_end": h["running"], "waiting_end": h["waiting"],
           "cancelled_delta": after["finished"].get("cancelled", 0) - before["finished"].get("cancelled", 0)}
    res["pass"] = bool(running_at_2s == 0 and h["running"] == 0 and h["kv_blocks_free"] == h["kv_blocks_total"])
    return res


# -------------------------------------------------------------------------------------------------------- big body

async def raw_upload(port: int, size: int, chunked: bool) -> dict:
    """POST `size` bytes with a raw socket, writing while reading: the time until the status line arrives, whatever
    happens to the rest of the upload (the server may answer and close before reading it)."""
    reader, writer = await asyncio.open_connection(HOST, port)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
            + ("Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {size}\r\n") + "\r\n").encode()
    block = b'{"model": "' + b"x" * (1 << 20)
    t0 = time.perf_counter()
    sent = 0
    write_error = None

    async def send() -> None:
        nonlocal sent, write_error
        try:
            writer.write(head)
            while sent < size:
                piece = block[: min(len(block), size - sent)]
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                await writer.drain()
                sent += len(piece)
            if chunked:
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (ConnectionError, OSError) as exc:
            write_error = type(exc).__name__

    sender = asyncio.create_task(send())
    status, elapsed, body = None, None, b""
    try:
        line = await asyncio.wait_for(reader.readline(), timeout=30)
        elapsed = time.perf_counter() - t0
        status = int(line.split()[1]) if line.startswith(b"HTTP/") else None
        headers = {}
        while True:
            h = await asyncio.wait_for(reader.readline(), timeout=10)
            if h in (b"\r\n", b""):
                break
            k, _, v = h.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        if "content-length" in headers:
            body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), timeout=10)
    except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError) as exc:
        body = repr(exc).encode()
    sender.cancel()
    try:
        await sender
    except asyncio.CancelledError:
        pass
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), timeout=2)
    except (asyncio.TimeoutError, ConnectionError, OSError):
        pass
    return {"status": status, "time_to_response_s": None if elapsed is None else round(elapsed, 4),
            "bytes_sent_before_response": sent, "json_error_body": is_json_error(status or 0, body),
            "write_error": write_error, "body": body[:160].decode("utf-8", "replace")}


async def bigbody_phase(server: Server, args) -> dict:
    url = server.url
    size = int(args.big_mb * 10**6)
    res = {"size_bytes": size}
    async with httpx.AsyncClient(timeout=10) as client:
        await wait_idle(client, url)
        await health(client, url)
        for variant in ("content_length", "chunked"):
            rss_before = server.rss_mb()
            lat: list[float] = []
            stop = asyncio.Event()

            async def poll() -> None:
                async with httpx.AsyncClient(timeout=10) as hc:
                    while not stop.is_set():
                        t = time.perf_counter()
                        await hc.get(url + "/health")
                        lat.append(time.perf_counter() - t)
                        await asyncio.sleep(0.01)

            poller = asyncio.create_task(poll())
            await asyncio.sleep(0.1)
            up = await raw_upload(server.port, size, chunked=variant == "chunked")
            await asyncio.sleep(0.2)
            stop.set()
            await poller
            await asyncio.sleep(0.5)
            rss_after = server.rss_mb()
            lat.sort()
            res[variant] = {**up, "rss_before_mb": round(rss_before, 1), "rss_after_mb": round(rss_after, 1),
                            "rss_growth_mb": round(rss_after - rss_before, 1),
                            "health_polls": len(lat), "health_latency_max_ms": round(lat[-1] * 1000, 1) if lat else None,
                            "health_latency_p50_ms": round(lat[len(lat) // 2] * 1000, 1) if lat else None}
            v = res[variant]
            v["pass"] = bool(v["status"] == 413 and v["time_to_response_s"] is not None and v["time_to_response_s"] < 1.0
                             and v["rss_growth_mb"] < 100 and v["health_latency_max_ms"] is not None
                             and v["health_latency_max_ms"] < 100)
        # the connection a 413 closed must leave the server usable
        r = await client.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        res["request_after_status"] = r.status_code
    res["pass"] = bool(res["content_length"]["pass"] and res["chunked"]["pass"] and res["request_after_status"] == 200)
    return res


# ----------------------------------------------------------------------------------------------------------- soak

async def soak_phase(server: Server, args) -> dict:
    url = server.url
    rng = random.Random(args.seed + 1)
    fuzzer = Fuzzer(args.seed + 2)
    counts: Counter = Counter()
    unexpected: Counter = Counter()
    samples: list[str] = []
    rss: list[tuple[float, float]] = []
    t0 = time.monotonic()
    deadline = t0 + args.soak_seconds

    def bad(kind: str, detail: str) -> None:
        unexpected[kind] += 1
        if len(samples) < 20:
            samples.append(f"{round(time.monotonic() - t0, 1)}s {kind}: {detail[:240]}")

    prompts = ["The history of Rome", "def quicksort(xs):", "Dear diary, today", "The three laws of motion are",
               "Once upon a time", "SELECT * FROM", "In 1969, the first", "A recipe for pancakes:"]

    async def client_loop(cid: int) -> None:
        async with httpx.AsyncClient(timeout=120) as c:
            while time.monotonic() < deadline:
                action = rng.choices(["stream", "nonstream", "chat_stream", "disconnect", "bad"],
                                     weights=[3, 3, 2, 2, 2])[0]
                counts[action] += 1
                max_tokens = rng.choice([8, 16, 32, 64, 96])
                temperature = rng.choice([0, 0, 0.8])
                try:
                    if action in ("stream", "disconnect"):
                        body = {"model": MODEL, "prompt": rng.choice(prompts), "max_tokens": max_tokens,
                                "temperature": temperature, "stream": True, "seed": rng.randrange(1000)}
                        out = await stream_text(c, url, "/v1/completions", body,
                                                stop_after_chunks=rng.randrange(1, 6) if action == "disconnect" else None)
                        if out["status"] != 200:
                            bad(f"status_{out['status']}", str(out))
                        elif out["error_event"]:
                            bad("stream_error_event", str(out["error_event"]))
                        elif not out["done"] and not out["left"]:
                            bad("stream_without_done", str(out))
                    elif action == "chat_stream":
                        body = {"model": MODEL, "messages": [{"role": "user", "content": rng.choice(prompts)}],
                                "max_tokens": max_tokens, "temperature": temperature, "stream": True,
                                "stream_options": {"include_usage": True}}
                        out = await stream_text(c, url, "/v1/chat/completions", body)
                        if out["status"] != 200:
                            bad(f"status_{out['status']}", str(out))
                        elif out["error_event"]:
                            bad("stream_error_event", str(out["error_event"]))
                        elif not out["done"]:
                            bad("stream_without_done", str(out))
                    elif action == "nonstream":
                        chat = rng.random() < 0.5
                        body = {"model": MODEL, "max_tokens": max_tokens, "temperature": temperature}
                        if chat:
                            body["messages"] = [{"role": "user", "content": rng.choice(prompts)}]
                        else:
                            body["prompt"] = rng.choice(prompts)
                        r = await c.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body)
                        if r.status_code != 200:
                            bad(f"status_{r.status_code}", r.text)
                        else:
                            r.json()["choices"][0]
                    else:
                        path, data, headers, kind = fuzzer.body()
                        try:
                            r = await c.post(url + path, content=data, headers=headers)
                        except httpx.HTTPError as exc:
                            if len(data) > args.max_body_mb * 2**20:  # the 413-then-close reset (see fuzz_phase)
                                counts[f"bad_oversize_{type(exc).__name__}"] += 1
                                continue
                            raise
                        if r.status_code >= 500:
                            bad(f"status_{r.status_code}", f"{kind} {data[:120]!r} -> {r.text}")
                        elif r.status_code >= 400 and not is_json_error(r.status_code, r.content):
                            bad("non_json_error", f"{r.status_code} {r.content[:120]!r}")
                        counts[f"bad_{r.status_code}"] += 1
                except httpx.HTTPError as exc:
                    bad(f"conn_{type(exc).__name__}", f"{action}: {exc!r}")
                except (ValueError, KeyError, IndexError) as exc:
                    bad("bad_body", f"{action}: {exc!r}")

    async def sampler() -> None:
        warm = False
        while time.monotonic() < deadline:
            now = time.monotonic() - t0
            rss.append((round(now, 1), round(server.rss_mb(), 1)))
            if not warm and now >= args.soak_warmup:
                warm = True
            await asyncio.sleep(5)

    await asyncio.gather(sampler(), *(client_loop(i) for i in range(args.soak_clients)))
    duration = time.monotonic() - t0
    async with httpx.AsyncClient(timeout=10) as client:
        h, idle_s = await wait_idle(client, url, 20)
        m = await metrics(client, url)
    rss_end = server.rss_mb()
    after_warm = next((v for t, v in rss if t >= args.soak_warmup), rss[0][1] if rss else None)
    growth = (rss_end - after_warm) / after_warm * 100 if after_warm else None
    res = {"seconds": round(duration, 1), "clients": args.soak_clients, "actions": dict(counts),
           "requests": sum(v for k, v in counts.items() if not k.startswith("bad_")),
           "unexpected_errors": sum(unexpected.values()), "unexpected_by_kind": dict(unexpected),
           "unexpected_samples": samples, "rss_after_warmup_mb": after_warm, "rss_end_mb": round(rss_end, 1),
           "rss_growth_pct": None if growth is None else round(growth, 2), "rss_peak_mb": max(v for _, v in rss),
           "rss_samples": rss[:: max(1, len(rss) // 20)], "health_end": h, "idle_wait_s": round(idle_s, 2),
           "metrics_end": m}
    res["pass"] = bool(res["unexpected_errors"] == 0 and growth is not None and abs(growth) <= 5
                       and h["running"] == 0 and h["waiting"] == 0 and h["kv_blocks_free"] == h["kv_blocks_total"])
    return res


# ----------------------------------------------------------------------------------------------------------- main

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", default="fuzz,orphans,bigbody,soak", help="comma list of fuzz,orphans,bigbody,soak")
    p.add_argument("--fuzz-requests", type=int, default=2000)
    p.add_argument("--fuzz-concurrency", type=int, default=8)
    p.add_argument("--fuzz-timeout", type=float, default=60.0, help="client timeout of one fuzzed request (s)")
    p.add_argument("--fuzz-max-seconds", type=float, default=900.0, help="stop sending fuzz after this long")
    p.add_argument("--orphans", type=int, default=20)
    p.add_argument("--orphan-timeout", type=float, default=1.0)
    p.add_argument("--orphan-wait", type=float, default=10.0, help="how long to poll /health afterwards (s)")
    p.add_argument("--big-mb", type=float, default=50.0)
    p.add_argument("--soak-seconds", type=float, default=600.0)
    p.add_argument("--soak-clients", type=int, default=16)
    p.add_argument("--soak-warmup", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-body-mb", type=float, default=4.0, help="the server's max_body_mb (default 4)")
    p.add_argument("--server-log", default="/tmp/serve_hardening_server.log")
    p.add_argument("--out", default="serve_hardening.json")
    p.add_argument("server_args", nargs="*", help="extra key=value settings for `specquant serve`")
    args = p.parse_args()
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]

    server = Server(args.server_log, args.server_args)
    results: dict = {"argv": sys.argv, "server_url": server.url, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                           time.gmtime())}
    try:
        results["startup_s"] = round(server.wait_ready(), 1)
        results["rss_start_mb"] = round(server.rss_mb(), 1)
        for phase in phases:
            t = time.monotonic()
            print(f"[{time.strftime('%H:%M:%S')}] phase {phase} ...", flush=True)
            if phase == "fuzz":
                results[phase] = asyncio.run(fuzz_phase(server.url, args))
            elif phase == "orphans":
                results[phase] = asyncio.run(orphans_phase(server.url, args))
            elif phase == "bigbody":
                results[phase] = asyncio.run(bigbody_phase(server, args))
            elif phase == "soak":
                results[phase] = asyncio.run(soak_phase(server, args))
            else:
                raise SystemExit(f"unknown phase {phase}")
            results[phase]["phase_wall_s"] = round(time.monotonic() - t, 1)
            print(f"  {phase}: pass={results[phase]['pass']} ({results[phase]['phase_wall_s']} s)", flush=True)
            with open(args.out, "w") as f:  # partial results survive an interrupted run
                json.dump(results, f, indent=1, default=str)
    finally:
        results["server_alive_at_end"] = server.proc.poll() is None
        results["server_log"] = server.log_findings()  # before the shutdown
        results["server_exit_code"] = server.stop()
        results["server_log_after_shutdown"] = server.log_findings()
        results["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)

    print("\nsummary")
    for phase in phases:
        r = results.get(phase, {})
        keys = {"fuzz": ["fuzz_requests", "status_counts", "five_xx", "non_json_error_bodies", "connection_errors",
                         "greedy_runs", "greedy_mismatches", "greedy_errors", "sequences_finished_error_delta"],
                "orphans": ["outcomes", "running_plus_waiting_2s_after_give_up", "first_idle_s_after_give_up",
                            "kv_blocks_free_end", "kv_blocks_total"],
                "bigbody": ["content_length", "chunked", "request_after_status"],
                "soak": ["seconds", "requests", "unexpected_errors", "unexpected_by_kind", "rss_after_warmup_mb",
                         "rss_end_mb", "rss_growth_pct", "health_end"]}[phase]
        print(f"{phase}: pass={r.get('pass')}")
        for k in keys:
            print(f"  {k}: {r.get(k)}")
    print(f"server log: {results['server_log']}  exit code {results['server_exit_code']}")
    print(f"wrote {args.out}")
    return 0 if all(results.get(ph, {}).get("pass") for ph in phases) else 1


if __name__ == "__main__":
    sys.exit(main())
