"""Join eval and bench results into one row per configuration (model or checkpoint x KV cache x speculation x the
engine settings that change its arithmetic, e.g. engine.native_dot=int8).

A configuration's quality comes from its latest eval result on the chosen dataset and its speed from its latest
bench result; each keeps the protocol it was measured under, so a row never mixes numbers without saying how each
was obtained."""

import importlib.util
from dataclasses import dataclass, field


def _config_part(result: dict, group: str, default: str) -> str:
    node = (result.get("config") or {}).get(group)
    if isinstance(node, dict):
        return str(node.get("kind") or node.get("name") or node.get("method") or default)
    return str(node) if node else default


# engine settings that change what the engine computes (so its quality and speed), with their defaults: a result
# run with another value is a configuration of its own (engine.native_dot=int8: int4 weights x int8 activations)
ENGINE_VARIANTS = {"native_dot": "fp32", "dtype": "auto", "weight_dtype": "auto", "prefill_dtype": "fp32"}


def engine_variant(result: dict) -> str:
    """The result's non-default ENGINE_VARIANTS as overrides ("engine.native_dot=int8"); "" for the defaults (and for
    results older than a setting, which ran its default)."""
    engine = (result.get("config") or {}).get("engine") or {}
    return " ".join(f"engine.{key}={engine[key]}" for key, default in ENGINE_VARIANTS.items()
                    if engine.get(key) not in (None, default))


def config_key(result: dict) -> tuple[str, str, str, str]:
    """(model, kv, spec, engine variant): what identifies a configuration across eval and bench results."""
    model = (result.get("config") or {}).get("model", {}).get("name") or result.get("model") or "?"
    kv = result.get("kv") or _config_part(result, "kv", "fp")
    node = (result.get("config") or {}).get("kv")
    dtype = node.get("dtype") if isinstance(node, dict) else None
    if dtype not in (None, "auto") and not str(kv).endswith(dtype):  # kv.dtype=fp16: a cache of its own, as KVSpec
        kv = f"{kv} {dtype}"  # names it ("fp fp16"; eval results already carry that name)
    spec = _config_part(result, "spec", "none")
    return str(model), str(kv), str(spec), engine_variant(result)


@dataclass
class Row:
    model: str
    kv: str
    spec: str
    variant: str = ""  # non-default engine settings (engine_variant), "" = the defaults
    label: str = ""
    quality: dict = field(default_factory=dict)  # the eval result's figures
    speed: dict = field(default_factory=dict)  # the bench result's figures
    quality_protocol: str = ""
    speed_protocol: str = ""
    peer: bool = False  # another tool's figures (transformers, llama.cpp), shown beside ours, never recommended
    beside: tuple = ()  # a llama.cpp row: the key of the row whose bench run it was interleaved with

    @property
    def key(self) -> tuple[str, str, str, str]:
        return self.model, self.kv, self.spec, self.variant

    @property
    def precision(self) -> str:
        """What the row's engine computed in: its bench result's dtype (with the weights' quantization), else its
        eval result's."""
        return str(self.speed.get("dtype") or self.quality.get("dtype") or "")

    def get(self, key: str):
        return self.quality.get(key, self.speed.get(key))

    @property
    def ppl_increase(self) -> float | None:
        q = self.quality
        if "ppl" in q and q.get("ref_ppl"):
            return q["ppl"] / q["ref_ppl"] - 1
        return None

    @property
    def tokens_per_s(self) -> float | None:
        return self.speed.get("decode_tokens_per_s")


def model_label(name: str) -> str:
    """A short name: a checkpoint directory's last part, a registry name as is."""
    return name.rstrip("/").rsplit("/", 1)[-1]


def speed_protocol(result: dict) -> str:
    threads = result.get("threads")
    text = (f"{result.get('prompts', '?')} prompts, {result.get('prompt_tokens', '?')} prompt + "
            f"{result.get('new_tokens', '?')} new tokens, {result.get('runs', '?')} runs, {threads} threads, "
            f"{result.get('dtype', '?')}")
    if result.get("spec"):
        text += (f", spec {result['spec']} (draft {result.get('draft', '?')}, k {result.get('k', '?')}"
                 f"{', adaptive' if result.get('adaptive') else ''}), interleaved with the same engine without "
                 f"speculation")
    if "decode_tokens_per_s" in (result.get("llamacpp") or {}):
        text += f", interleaved with llama.cpp {gguf_type(result['llamacpp'])} on the same prompt token ids"
    machine = result.get("machine") or {}
    if machine.get("cpu"):
        text += f", {machine['cpu']}"
    return text


def quality_protocol(result: dict) -> str:
    protocol = result.get("protocol") or {}
    parts = [p["text"] for p in protocol.values() if isinstance(p, dict) and p.get("text")]
    reference = result.get("reference")
    return "; ".join(parts) + (f"; reference {reference}" if reference else "")


def build_rows(results: list[dict], data: str | None = None) -> list[Row]:
    """Rows in order of first appearance; the latest result of each kind wins. `data`: only eval results on this
    dataset (e.g. "pydoc" or "pydoc/evaluation"); None = any. A row whose bench result also ran llama.cpp is
    followed by a llama.cpp row of that run; transformers' rows come last."""
    rows: dict[tuple, Row] = {}
    for result in results:
        if result.get("kind") == "eval" and data and not str(result.get("data", "")).startswith(data):
            continue
        if (result.get("config") or {}).get("bench"):  # a dedicated benchmark (e.g. paged KV): no speed row
            continue
        key = config_key(result)
        label = [model_label(key[0]), f"kv {key[1]}", f"spec {key[2]}"] + ([key[3]] if key[3] else [])
        row = rows.setdefault(key, Row(*key, label=", ".join(label)))
        if result["kind"] == "eval":
            row.quality, row.quality_protocol = result, quality_protocol(result)
        else:
            row.speed, row.speed_protocol = result, speed_protocol(result)
    for (model, kv, spec, variant), row in rows.items():
        if kv != "fp" and spec == "none" and row.quality:
            _borrow_items_from_fp_cache(row, rows.get((model, "fp", "none", variant)))
    for (model, kv, spec, variant), row in rows.items():
        plain = rows.get((model, kv, "none", variant))
        if spec != "none" and not row.quality and plain is not None and plain.quality:
            # speculative decoding verifies every token against the target (greedy: exactly its tokens), so its
            # quality is the target's: borrowed from the same model and cache without speculation, and said so
            row.quality = plain.quality
            row.quality_protocol = plain.quality_protocol  # the same protocol mark; the legend says why
    out = []
    for row in rows.values():
        out += [row] + [peer for peer in [llamacpp_row(row)] if peer is not None]
    return out + peer_rows(results, rows)


def kv_type_text(peer: dict) -> str:
    """llama.cpp's KV cache type in a result's `llamacpp` figures (f16 where a run predates the field)."""
    return str(peer.get("kv_type") or "f16")


def gguf_type(peer: dict) -> str:
    """The GGUF type llama.cpp ran (F16, Q8_0, Q4_0) from a result's `llamacpp` figures."""
    if peer.get("gguf_type"):
        return str(peer["gguf_type"])
    dtype = str(peer.get("dtype") or "?")  # "llama.cpp F16, same weights": the type alone
    return dtype.removeprefix("llama.cpp").split(",")[0].strip() or dtype


def llamacpp_row(row: Row) -> Row | None:
    """llama.cpp's figures from the bench run behind `row` (`specquant bench baseline=llamacpp`: the same prompt
    token ids and threads, interleaved with the engine's runs), as a row of its own; None if that run had none."""
    result = row.speed
    peer = result.get("llamacpp") or {}
    if "decode_tokens_per_s" not in peer:
        return None
    kind = gguf_type(peer)
    agreement = result.get("greedy_token_agreement_vs_llamacpp")
    label = (f"llama.cpp {kind} (same prompts, interleaved with {row.label}"
             + (f"; greedy token agreement {agreement:.3f}" if agreement is not None else "") + ")")
    speed = {k: peer[k] for k in ("decode_tokens_per_s", "ttft_ms", "itl_ms", "decode_floor", "peak_rss_mb")
             if k in peer}
    speed["dtype"] = f"GGUF {kind} (llama.cpp)"
    protocol = (f"{result.get('prompts', '?')} prompts, {peer.get('prompt_tokens', result.get('prompt_tokens', '?'))}"
                f" prompt + {peer.get('new_tokens', result.get('new_tokens', '?'))} new tokens, "
                f"{peer.get('runs', result.get('runs', '?'))} runs, {result.get('threads', '?')} threads, llama.cpp "
                f"(llama-cpp-python) on {_weights_text(peer, kind)}, its own {kv_type_text(peer)} KV cache, greedy on the engine's "
                f"prompt token ids, interleaved with the engine's run")
    machine = result.get("machine") or {}
    if machine.get("cpu"):
        protocol += f", {machine['cpu']}"
    return Row(row.model, "llama.cpp", kind, row.variant, label=label, speed=speed, peer=True, beside=row.key,
               speed_protocol=protocol)


def _weights_text(peer: dict, kind: str) -> str:
    """Which weights llama.cpp ran: the engine's own, exported (`specquant export format=gguf`), or the registry's
    GGUF requantized to the nearest type (older runs, and checkpoints whose grid no GGUF type holds)."""
    if peer.get("weights") == "same weights":
        return f"the engine's own weights exported as GGUF {kind} (specquant export format=gguf)"
    return f"the model's GGUF requantized by llama.cpp to {kind} (the type nearest the engine's weights, not its exact weights)"


def peer_rows(results: list[dict], rows: dict) -> list[Row]:
    """Rows for the tools a user would otherwise reach for, measured in our bench runs beside our engine on the
    float model in fp32: transformers `generate()` (the baseline of a no-spec bench of the float model) and its
    assisted generation with prompt lookup (the peer of a spec=lookup bench). Their quality is the reference's:
    they run the very model the evals compare against."""
    latest = {}
    for result in results:
        if result.get("kind") != "bench" or (result.get("config") or {}).get("bench"):
            continue
        model, _, spec, _ = config_key(result)
        if "/" in model:  # a checkpoint: its baseline is the same float model; the float model's own runs decide
            continue
        if spec == "none" and "baseline" in result:
            latest["generate"] = (model, result)
        if "peer_assisted" in result:  # one row per kind of draft: prompt lookup, a draft model
            latest["assisted-draft" if "draft" in result["peer_assisted"] else "assisted"] = (model, result)
    out = []
    for name, (model, result) in sorted(latest.items(), key=lambda item: item[0] != "generate"):
        quality_row = rows.get((model, "fp", "none", ""))
        peer = result["baseline"] if name == "generate" else result["peer_assisted"]
        if name == "generate":
            label = f"peer: transformers generate(), {model} {peer.get('dtype', 'fp32')}"
            speed = {k: peer[k] for k in ("decode_tokens_per_s", "ttft_ms", "itl_ms", "dtype") if k in peer}
        else:
            how = f"draft model {peer['draft']}" if "draft" in peer else f"prompt lookup, k={peer['k']}"
            label = f"peer: transformers assisted generation ({how}), {model} {peer['dtype']}"
            speed = {**{k: peer["assisted"][k] for k in ("decode_tokens_per_s", "ttft_ms")},
                     "itl_ms": {"mean": 1000 / peer["assisted"]["decode_tokens_per_s"]},
                     "speedup_vs_nospec": peer["speedup_vs_generate"], "identical_outputs": peer["identical_outputs"],
                     "dtype": peer["dtype"]}
        protocol = (f"{result.get('prompts', '?')} prompts, {result.get('prompt_tokens', '?')} prompt + "
                    f"{result.get('new_tokens', '?')} new tokens, {peer.get('runs', result.get('runs', '?'))} runs, "
                    f"{result.get('threads', '?')} threads, transformers on {model} {peer.get('dtype', 'fp32')} "
                    f"with its own cache, interleaved with our engine's run")
        if name.startswith("assisted"):
            protocol += ("; x no-spec: over transformers' own generate() interleaved with it; TTFT: its first "
                         "streamed chunk")
        row = Row(model, "transformers", name, label=label, speed=speed, peer=True, speed_protocol=protocol)
        if quality_row is not None and quality_row.quality:
            q = quality_row.quality
            row.quality = {"ppl": q.get("ref_ppl"), "ref_ppl": q.get("ref_ppl"), "kl": 0.0, "top1_agreement": 1.0,
                           **{k: q[f"ref_{k}"] for k in ("cloze_accuracy", "mc_accuracy") if f"ref_{k}" in q},
                           **{f"ref_{k}": q[f"ref_{k}"] for k in ("cloze_accuracy", "mc_accuracy") if f"ref_{k}" in q}}
            row.quality = {k: v for k, v in row.quality.items() if v is not None}
            row.quality_protocol = quality_row.quality_protocol + "; this row is the reference model itself"
        out.append(row)
    return out


BORROWABLE = {"cloze": ("cloze_accuracy", "ref_cloze_accuracy"),
              "mc": ("mc_accuracy", "ref_mc_accuracy", "mc_accuracy_norm", "ref_mc_accuracy_norm"),
              "gen": ("gen_prefix_match", "gen_token_agreement")}


def _tokens_held(task: str, protocol: dict) -> int | None:
    """The most tokens the cache holds when a task's scored tokens read it: a cloze/mc passage (its continuation
    is fed in one step, reading only the passage), a gen prompt plus its new tokens."""
    if task in ("cloze", "mc"):
        return protocol.get("max_context")
    if task == "gen" and "prompt_tokens" in protocol:
        return protocol["prompt_tokens"] + protocol.get("new_tokens", 0)
    return None


def _borrow_items_from_fp_cache(row: Row, fp_row: Row | None) -> None:
    """Cloze / mc / gen figures for a quantized-KV row that was not scored on them, from the same weights with
    the fp cache, only where they are provably the same: every token the task's scores read back sits in the
    cache's full-precision residual window (KIVI's most recent tokens, never quantized), so the scores are what
    an fp cache gives."""
    if fp_row is None:
        return
    residual = ((row.quality.get("config") or {}).get("kv") or {}).get("residual")
    if residual is None:
        return
    borrowed, notes = {}, []
    for task, keys in BORROWABLE.items():
        protocol = (fp_row.quality.get("protocol") or {}).get(task) or {}
        held = _tokens_held(task, protocol)
        if keys[0] in row.quality or keys[0] not in fp_row.quality or held is None or held > residual:
            continue
        borrowed.update({k: fp_row.quality[k] for k in keys if k in fp_row.quality})
        notes.append(f"{task} ({held} tokens)")
    if borrowed:
        row.quality = {**row.quality, **borrowed}
        row.quality_protocol += (f"; {', '.join(notes)} from the kv=fp row: that many tokens stay in the quantized "
                                 f"cache's full-precision residual window (kv.residual={residual}), so the cache "
                                 f"does not change them")


def peer_notes(rows: list[Row]) -> list[str]:
    """A visible line for each peer the table lacks, and why."""
    have = {r.spec for r in rows if r.peer and r.kv == "transformers"}
    notes = []
    if "generate" not in have:
        notes.append("transformers generate(): no no-spec bench of a float model with baseline=hf in the store")
    if "assisted" not in have:
        notes.append("transformers assisted generation: no spec=lookup kv=fp bench of a float model with "
                     "baseline=hf in the store")
    if not any(r.peer and r.kv == "llama.cpp" for r in rows):
        notes.append(f"llama.cpp: {_llamacpp_missing(rows)}, so there is no llama.cpp row")
    return notes


def _llamacpp_missing(rows: list[Row]) -> str:
    """Why no row ran llama.cpp: what the bench runs that asked for it said, else whether it can run here."""
    said = [r.speed["llamacpp"]["unavailable"] for r in rows
            if isinstance(r.speed.get("llamacpp"), dict) and r.speed["llamacpp"].get("unavailable")]
    if said:
        return f"the bench runs that asked for it could not run it ({said[-1]})"
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed here (it needs a source build)"
    return "no bench result in the store ran it (`specquant bench baseline=llamacpp`; eval/sweep.sh does)"
