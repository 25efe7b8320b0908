"""The server under test for benchmarks/serve_hardening.py: `specquant serve` as a subprocess on a free 127.0.0.1
port (readiness, RSS, graceful stop, what its log shows), and the client side every phase shares (/health, the crash
counters of /metrics, waiting for idle, one streaming request, whether an error body is OpenAI-style JSON)."""

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import time

import httpx
import psutil

HOST = "127.0.0.1"
MODEL = "smollm2-135m"


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


def is_json_error(status: int, content: bytes) -> bool:
    try:
        body = json.loads(content)
    except ValueError:
        return False
    return isinstance(body, dict) and isinstance(body.get("error"), dict) and "message" in body["error"]
