"""Load benchmark of `specquant serve`: N concurrent streaming clients against the server on loopback, and the same
requests served one at a time, in one run.

    python -m benchmarks.serve [--clients 16] [--duration 120] [--sequential-duration 60] [--max-tokens 128]
                               [--model CHECKPOINT_OR_NAME] [--prompts open] [--out result.json]
                               [--kv-tokens N | --kv-budget-mb MB] [--block-size 16] [--no-prefix-cache]
                               [--kv fp|int8|int4|int2] [--spec none|lookup] [--spec-k 8] [--spec-max-batch 4]
                               [--spec-set KEY=VALUE ...]

Protocol: a fixed list of requests (prompts of the --prompts set cut to 128, 256, 384 and 512 tokens in turn, greedy,
--max-tokens new tokens each, stopping early only at the model's end-of-sequence) is served twice by one server
process (started for the run, in its own process, as in production; the clients are coroutines on one event loop in
this one, so they neither share the server's GIL nor spend a core of their own): first one request at a time for --sequential-duration seconds (requests 0, 1, 2, ... of the list), then by
--clients concurrent streaming clients for --duration seconds (the same list from the start, each client taking the
next request when its last one ends; requests in flight at the deadline are finished and counted). Throughput is
completion tokens (the server's usage counts) over wall time of each phase; the ratio of the two is what batching
buys. TTFT (request sent -> first text chunk) and ITL (gaps between text chunks; a chunk is one token unless text was
held back at a partial character or a possible stop string) are measured by the clients under load. RSS of the server
process is sampled every second over the load phase.

The server's KV block pool holds --kv-tokens (default: max_batch x (512 + max_tokens), every client's worst case)
or --kv-budget-mb; a smaller pool admits by free blocks and preempts when it runs out (preemptions are reported).
The list has 32 distinct requests and repeats: with prefix caching (the default) a repeated prompt reuses its
cached blocks, as a server would in practice; --no-prefix-cache measures every prompt prefilled in full.

--kv quantizes the KV blocks (the server's kv=); --spec lookup serves with prompt-lookup speculative decoding while
the batch has at most --spec-max-batch rows (the server's spec=lookup); the acceptance rate is reported. With
speculation several tokens can reach a client in one scheduler turn, so ITL gaps of ~0 ms appear.

The model is SmolLM2-135M's INT4 checkpoint when one is in ~/.cache/specquant/checkpoints, else the float model.
"""

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time

import httpx
import psutil

from toolkit.timing import percentiles

PROMPT_LENGTHS = (128, 256, 384, 512)


def default_model() -> str:
    from toolkit.paths import home

    root = home() / "checkpoints"
    found = sorted(root.glob("smollm2-135m*int4*")) if root.is_dir() else []
    return str(found[0]) if found else "smollm2-135m"


def request_list(tokenizer, prompt_set: str, n_per_length: int) -> list[str]:
    from toolkit.data import build_prompts

    by_length = [build_prompts(prompt_set, tokenizer, length, n_per_length) for length in PROMPT_LENGTHS]
    # interleave lengths so every stretch of the list has the same mix
    return [by_length[j][i].text for i in range(n_per_length) for j in range(len(PROMPT_LENGTHS))]


async def stream_one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    sent = time.perf_counter()
    chunk_times, usage, error = [], None, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return {"error": f"HTTP {response.status_code}: {response.text[:200]}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]["message"]
                    break
                if event["choices"] and event["choices"][0].get("text"):
                    chunk_times.append(time.perf_counter())
                usage = event.get("usage") or usage
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    if error or usage is None:
        return {"error": error or "stream ended without usage"}
    return {"tokens": usage["completion_tokens"], "prompt_tokens": usage["prompt_tokens"],
            "ttft_s": chunk_times[0] - sent if chunk_times else None,
            "itl_s": [b - a for a, b in zip(chunk_times, chunk_times[1:])], "end": time.perf_counter()}


async def run_sequential(url, model, requests, max_tokens, duration) -> dict:
    results, start = [], time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        for prompt in requests:
            if time.perf_counter() - start >= duration:
                break
            results.append(await stream_one(client, url, model, prompt, max_tokens))
    return summarize(results, time.perf_counter() - start)


async def run_concurrent(url, model, requests, max_tokens, clients, duration, server_pid: int, rss: list) -> dict:
    """`clients` coroutines on one event loop, each sending the next request of the list when its last one ends,
    until `duration` has passed; the server's RSS is sampled every second meanwhile."""
    results, next_index = [], [0]
    start = time.perf_counter()
    deadline = start + duration

    async def client_loop(client):
        while time.perf_counter() < deadline:
            prompt = requests[next_index[0] % len(requests)]
            next_index[0] += 1
            results.append(await stream_one(client, url, model, prompt, max_tokens))

    async def sample_rss(done: asyncio.Event):
        process = psutil.Process(server_pid)
        while not done.is_set():
            rss.append((time.perf_counter() - start, process.memory_info().rss / 2**20))
            try:
                await asyncio.wait_for(done.wait(), 1.0)
            except TimeoutError:
                pass

    done = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(done))
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients)) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    done.set()
    await sampler
    return summarize(results, time.perf_counter() - start)


def summarize(results: list[dict], wall_s: float) -> dict:
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft_s"] * 1e3 for r in ok if r["ttft_s"] is not None]
    itl = [g * 1e3 for r in ok for g in r["itl_s"]]
    return {"requests": len(results), "errors": len(errors), "error_examples": errors[:3],
            "completion_tokens": tokens, "prompt_tokens": sum(r["prompt_tokens"] for r in ok), "wall_s": wall_s,
            "tokens_per_s": tokens / wall_s if wall_s else 0.0,
            "ttft_ms": percentiles(ttft, (50, 99)) if ttft else None,
            "itl_ms": percentiles(itl, (50, 99)) if itl else None}


def rss_summary(samples: list[tuple[float, float]]) -> dict:
    if len(samples) < 4:
        return {"samples": len(samples)}
    values = [v for _, v in samples]
    half = samples[len(samples) // 2:]
    # least-squares slope over the second half: after warm-up (buffers grown, allocator settled) it should be ~0
    xs, ys = [t for t, _ in half], [v for _, v in half]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / (sum((x - mx) ** 2 for x in xs) or 1)
    return {"samples": len(samples), "first_mb": values[0], "last_mb": values[-1], "max_mb": max(values),
            "second_half_slope_mb_per_min": slope * 60}


def serve_in_child(conn, args: argparse.Namespace) -> None:
    """The server process: load the model, start the server on loopback, send (url, model, request list), then
    answer "stats" with the scheduler's counters until "stop"."""
    from omegaconf import OmegaConf

    from toolkit.engine.setup import default_engine_config, load_engine_model
    from toolkit.kv import KVSpec
    from toolkit.serve.server import BackgroundServer, ServeSettings, build_state

    engine = default_engine_config(threads=args.threads)
    loaded = load_engine_model(args.model or default_model(), engine)
    requests = request_list(loaded.tokenizer, args.prompts, 8)
    max_batch = args.max_batch or args.clients
    settings = ServeSettings(model_id="bench", max_batch=max_batch, max_queue=4 * args.clients,
                             max_kv_tokens=args.kv_tokens or max_batch * (max(PROMPT_LENGTHS) + args.max_tokens),
                             max_seq_len=max(PROMPT_LENGTHS) + args.max_tokens + 16, max_tokens=args.max_tokens,
                             kv_budget_mb=args.kv_budget_mb, block_size=args.block_size,
                             prefix_cache=not args.no_prefix_cache, kv=KVSpec.from_node(args.kv),
                             spec=OmegaConf.merge({"kind": args.spec, "k": args.spec_k},
                                                  OmegaConf.from_dotlist(args.spec_set)),
                             spec_max_batch=args.spec_max_batch)
    with BackgroundServer(build_state(loaded, settings)) as server:
        conn.send({"url": server.url, "model": loaded.name, "dtype": loaded.precision.name, "requests": requests,
                   "max_batch": max_batch})
        scheduler = server.state.scheduler
        while conn.recv() == "stats":
            pool = scheduler.cache.pool
            conn.send({"peak_batch": scheduler.peak_batch,
                       "kv": {"blocks": pool.num_blocks, "block_size": pool.block_size,
                              "pool_mb": scheduler.cache.storage.nbytes / 2**20,
                              "peak_blocks_used": scheduler.peak_blocks_used, "preemptions": scheduler.preemptions,
                              "prefix_cache": not args.no_prefix_cache, "prefix_hit_rate": pool.stats.hit_rate,
                              "evictions": pool.stats.evictions, "kind": args.kv},
                       "spec": {"rounds": scheduler.spec_rounds, "proposed": scheduler.spec_proposed,
                                "accepted": scheduler.spec_accepted}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="registry name, directory or checkpoint (default: see above)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of concurrent load")
    parser.add_argument("--sequential-duration", type=float, default=60.0, help="seconds of one-at-a-time serving")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts", default="open", help="prompt set")
    parser.add_argument("--max-batch", type=int, default=None, help="default: --clients")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kv-tokens", type=int, default=None, help="KV pool in tokens (default: every client's "
                        "worst case)")
    parser.add_argument("--kv-budget-mb", type=float, default=None, help="KV pool in MiB (instead of --kv-tokens)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-prefix-cache", action="store_true", help="prefill every prompt in full")
    parser.add_argument("--kv", default="fp", help="KV block kind: fp, int8, int4 or int2")
    parser.add_argument("--spec", default="none", help="speculative decoding: none or lookup")
    parser.add_argument("--spec-k", type=int, default=8, help="tokens drafted per round (--spec lookup)")
    parser.add_argument("--spec-set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="more spec options, as the server's spec.KEY=VALUE (e.g. ngram_min=2 adaptive=true)")
    parser.add_argument("--spec-max-batch", type=int, default=4, help="speculate only while the batch has at most "
                        "this many rows")
    parser.add_argument("--out", default=None, help="write the result JSON here")
    args = parser.parse_args()

    # The server runs in its own process, as it would in production: clients in the same interpreter would hold its
    # GIL (16 client threads there made a 16-row decode step 234 ms instead of ~150 ms).
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    server = context.Process(target=serve_in_child, args=(child_conn, args), name="specquant-bench-server")
    server.start()
    try:
        if not conn.poll(600):
            raise RuntimeError("the server process did not start within 600 s")
        info = conn.recv()
        result = asyncio.run(measure(args, info, server.pid))
        conn.send("stats")
        stats = conn.recv()
    finally:
        if server.is_alive():
            conn.send("stop")
        server.join(timeout=60)
    report(args, info, result, stats)


async def measure(args, info: dict, server_pid: int) -> dict:
    url, requests = info["url"], info["requests"]
    print(f"{info['model']} ({info['dtype']}); {len(requests)} distinct requests of "
          f"{'/'.join(map(str, PROMPT_LENGTHS))}-token prompts, {args.max_tokens} new tokens, greedy, kv={args.kv}, "
          f"spec={args.spec}")
    async with httpx.AsyncClient(timeout=600) as client:  # warm-up, untimed: first calls pay one-off costs
        await stream_one(client, url, "bench", requests[0], 8)
    print(f"one at a time for {args.sequential_duration:g} s ...", flush=True)
    sequential = await run_sequential(url, "bench", requests, args.max_tokens, args.sequential_duration)
    print(f"{args.clients} concurrent clients for {args.duration:g} s ...", flush=True)
    rss: list = []
    concurrent = await run_concurrent(url, "bench", requests, args.max_tokens, args.clients, args.duration,
                                      server_pid, rss)
    return {"sequential": sequential, "concurrent": concurrent, "rss": rss}


def report(args, info: dict, measured: dict, stats: dict) -> None:
    sequential, concurrent, rss = measured["sequential"], measured["concurrent"], measured["rss"]
    peak_batch, kv, max_batch = stats["peak_batch"], stats["kv"], info["max_batch"]
    spec = {"kind": args.spec, "k": args.spec_k, "max_batch": args.spec_max_batch, "options": args.spec_set,
            **stats["spec"],
            "acceptance_rate": stats["spec"]["accepted"] / stats["spec"]["proposed"] if stats["spec"]["proposed"]
            else None}
    ratio = concurrent["tokens_per_s"] / sequential["tokens_per_s"] if sequential["tokens_per_s"] else None
    result = {"model": info["model"], "dtype": info["dtype"], "clients": args.clients, "max_batch": max_batch,
              "max_tokens": args.max_tokens, "prompt_lengths": PROMPT_LENGTHS, "sequential": sequential,
              "concurrent": concurrent, "throughput_ratio": ratio, "peak_batch": peak_batch, "kv": kv,
              "spec": spec, "rss": rss_summary(rss), "rss_samples": rss}
    s, c = sequential, concurrent
    print(f"one at a time: {s['requests']} requests, {s['errors']} errors, {s['tokens_per_s']:.1f} tok/s, "
          f"TTFT p50 {s['ttft_ms']['p50']:.0f} ms, ITL p50 {s['itl_ms']['p50']:.1f} ms")
    print(f"{args.clients} clients:   {c['requests']} requests, {c['errors']} errors, {c['tokens_per_s']:.1f} tok/s "
          f"(x{ratio:.2f}), TTFT p50 {c['ttft_ms']['p50']:.0f} / p99 {c['ttft_ms']['p99']:.0f} ms, "
          f"ITL p50 {c['itl_ms']['p50']:.1f} / p99 {c['itl_ms']['p99']:.1f} ms, peak batch {peak_batch}")
    print(f"KV pool: {kv['blocks']} blocks of {kv['block_size']} ({kv['pool_mb']:.0f} MiB), peak "
          f"{kv['peak_blocks_used']} used, {kv['preemptions']} preemptions, prefix cache "
          f"{'hit rate ' + format(kv['prefix_hit_rate'], '.0%') if kv['prefix_cache'] else 'off'}, "
          f"{kv['evictions']} evictions")
    if args.spec != "none":
        rate = spec["acceptance_rate"]
        print(f"spec=lookup k={args.spec_k} (batch <= {args.spec_max_batch}): {spec['rounds']} verify passes, "
              f"{spec['accepted']}/{spec['proposed']} drafted tokens accepted"
              + (f" ({rate:.0%})" if rate is not None else ""))
    r = result["rss"]
    if "first_mb" in r:
        print(f"RSS under load: first {r['first_mb']:.0f} MB, last {r['last_mb']:.0f} MB, max {r['max_mb']:.0f} MB, "
              f"second-half slope {r['second_half_slope_mb_per_min']:+.1f} MB/min")
    if c["error_examples"] or s["error_examples"]:
        print("errors:", s["error_examples"] + c["error_examples"])
    if args.out:
        from toolkit.results import write_result

        write_result(args.out, result)


if __name__ == "__main__":
    main()
