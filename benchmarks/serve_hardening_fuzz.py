"""The fuzz phase of benchmarks/serve_hardening.py: fuzzed bodies (junk bytes, malformed JSON, wrong content types and
encodings, mutated fields: huge, non-finite, deeply nested, odd and invalid strings) to /v1/completions and
/v1/chat/completions while four greedy streams loop beside them and must equal their solo output."""

import asyncio
import json
import random
import time
from collections import Counter

import httpx

from benchmarks.serve_hardening_server import (
    MODEL,
    is_json_error,
    metrics,
    stream_text,
    wait_idle,
)

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
