"""specquant serve: load a model (registry name, directory or quantized checkpoint) and serve it over HTTP."""

from rich.console import Console

from toolkit.engine.setup import load_engine_model
from toolkit.engine.spec import EngineSpec
from toolkit.errors import InputError
from toolkit.kv import KVSpec
from toolkit.serve.server import ServeSettings, build_state, serve_forever
from toolkit.serve.speculation import serve_spec

console = Console(stderr=True)


def run(cfg) -> None:

    serve_spec(cfg.spec, int(cfg.spec_max_batch))  # a spec the server cannot run is refused before the model loads
    engine, kv = EngineSpec.from_node(cfg.engine), KVSpec.from_node(cfg.kv)  # resolved once, before the model loads
    if kv.window:
        raise InputError(f"kv.window={kv.window}: the server's paged cache keeps every token of a conversation",
                         "drop kv.window (max_seq_len bounds a conversation), or use `specquant generate` with it")
    loaded = load_engine_model(cfg.model.name, engine)
    settings = ServeSettings(host=cfg.host, port=int(cfg.port), api_key=cfg.api_key, model_id=cfg.served_name,
                             max_batch=cfg.max_batch, max_queue=cfg.max_queue, max_kv_tokens=cfg.max_kv_tokens,
                             max_seq_len=cfg.max_seq_len, max_tokens=cfg.max_tokens, kv_budget_mb=cfg.kv_budget_mb,
                             block_size=int(cfg.block_size), prefix_cache=bool(cfg.prefix_cache), kv=kv,
                             spec=cfg.spec, spec_max_batch=int(cfg.spec_max_batch),
                             max_body_mb=float(cfg.max_body_mb), drain_timeout_s=float(cfg.drain_timeout_s))
    state = build_state(loaded, settings)
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and cfg.api_key is None:
        console.print(f"[bold yellow]warning:[/] serving on {cfg.host} without api_key: anyone who can reach it "
                      "can use it", highlight=False)
    scheduler = state.scheduler
    limits, pool = scheduler.limits, scheduler.cache.pool
    console.print(f"[dim]{loaded.name} {loaded.precision.name} as {state.model_id!r} on http://{cfg.host}:{cfg.port}"
                  f"/v1 | max_batch {limits.max_batch} | max_queue {limits.max_queue} | KV pool {pool.num_blocks} "
                  f"blocks of {pool.block_size} = {scheduler.kv_capacity_tokens} tokens, "
                  f"{scheduler.cache.storage.nbytes / 2**20:.0f} MiB | prefix cache "
                  f"{'on' if limits.prefix_cache else 'off'} | max_seq_len {limits.max_seq_len} | kv {kv.kind} | "
                  f"spec {_describe_spec(scheduler.spec)}[/]", highlight=False)
    serve_forever(state, cfg.host, int(cfg.port))


def _describe_spec(spec) -> str:
    if spec is None:
        return "none"
    k = f"k {spec.length.k_min}..{spec.length.k_max} adaptive" if spec.length.adaptive else f"k {spec.length.k}"
    return spec.draft.describe(f", {k}, while the batch has <= {spec.max_batch} rows")
