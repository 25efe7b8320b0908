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

# The CLI and the order of the phases; the server under test and the client helpers are in
# serve_hardening_server.py, the fuzz phase in serve_hardening_fuzz.py, the other phases in serve_hardening_phases.py.

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

if not __package__:  # run as `python benchmarks/serve_hardening.py` (docs/serving.md): the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serve_hardening_fuzz import fuzz_phase
from benchmarks.serve_hardening_phases import bigbody_phase, orphans_phase, soak_phase
from benchmarks.serve_hardening_server import Server

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
