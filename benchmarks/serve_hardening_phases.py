"""The orphans, bigbody and soak phases of benchmarks/serve_hardening.py: clients that give up on non-streaming
requests, an oversized body (declared and chunked) against the 413 and the server's RSS and /health latency, and a
soak of mixed clients for a while."""

import asyncio
import random
import time
from collections import Counter

import httpx

from benchmarks.serve_hardening_fuzz import Fuzzer
from benchmarks.serve_hardening_server import (
    HOST,
    MODEL,
    Server,
    health,
    is_json_error,
    metrics,
    stream_text,
    wait_idle,
)

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
