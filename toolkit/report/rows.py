"""Join eval and bench results into one row per configuration (model or checkpoint x KV cache x speculation).

A configuration's quality comes from its latest eval result on the chosen dataset and its speed from its latest
bench result; each keeps the protocol it was measured under, so a row never mixes numbers without saying how each
was obtained."""

from dataclasses import dataclass, field


def _config_part(result: dict, group: str, default: str) -> str:
    node = (result.get("config") or {}).get(group)
    if isinstance(node, dict):
        return str(node.get("kind") or node.get("name") or node.get("method") or default)
    return str(node) if node else default


def config_key(result: dict) -> tuple[str, str, str]:
    """(model, kv, spec): what identifies a configuration across eval and bench results."""
    model = (result.get("config") or {}).get("model", {}).get("name") or result.get("model") or "?"
    kv = result.get("kv") or _config_part(result, "kv", "fp")
    spec = _config_part(result, "spec", "none")
    return str(model), str(kv), str(spec)


@dataclass
class Row:
    model: str
    kv: str
    spec: str
    label: str = ""
    quality: dict = field(default_factory=dict)  # the eval result's figures
    speed: dict = field(default_factory=dict)  # the bench result's figures
    quality_protocol: str = ""
    speed_protocol: str = ""

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
    dataset (e.g. "pydoc" or "pydoc/evaluation"); None = any."""
    rows: dict[tuple, Row] = {}
    for result in results:
        if result.get("kind") == "eval" and data and not str(result.get("data", "")).startswith(data):
            continue
        if (result.get("config") or {}).get("bench"):  # a dedicated benchmark (e.g. paged KV): no speed row
            continue
        key = config_key(result)
        row = rows.setdefault(key, Row(*key, label=", ".join([model_label(key[0]), f"kv {key[1]}",
                                                                f"spec {key[2]}"])))
        if result["kind"] == "eval":
            row.quality, row.quality_protocol = result, quality_protocol(result)
        else:
            row.speed, row.speed_protocol = result, speed_protocol(result)
    for (model, kv, spec), row in rows.items():
        plain = rows.get((model, kv, "none"))
        if spec != "none" and not row.quality and plain is not None and plain.quality:
            # speculative decoding verifies every token against the target (greedy: exactly its tokens), so its
            # quality is the target's: borrowed from the same model and cache without speculation, and said so
            row.quality = plain.quality
            row.quality_protocol = plain.quality_protocol + "; speculation is lossless: quality of the target"
    return list(rows.values())
