"""What a quality number means: the protocol stored and printed beside every figure.

Perplexities in the literature disagree mostly through unstated protocols (window length, stride, whether a BOS
token starts each window, which tokens are scored), so each result carries this record and the report prints it."""

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class WindowProtocol:
    """Perplexity/KL/top-1 over token windows of held-out text."""

    tokenizer: str  # the tokenizer's name or path (its vocabulary decides what a "token" is)
    data: str  # dataset name and split, e.g. "pydoc/evaluation"
    window: int = 512  # tokens per window, BOS included
    stride: int = 511  # text tokens each window advances by; = the text tokens a window holds: non-overlapping
    bos_token_id: int | None = None  # prepended to every window (None: the tokenizer has no BOS; nothing added)
    windows: int = 0  # how many windows were scored
    scored_tokens: int = 0  # tokens whose prediction counts (every position after the first of each window)
    chunk: int | None = None  # tokens fed through the KV cache at a time (None: one forward per window)
    kv: str = "fp"  # the candidate's KV cache kind

    def describe(self) -> str:
        bos = f"BOS id {self.bos_token_id} first" if self.bos_token_id is not None else "no BOS"
        text_tokens = self.window - (self.bos_token_id is not None)
        overlap = "non-overlapping" if self.stride >= text_tokens else f"stride {self.stride}"
        feed = f", fed {self.chunk} tokens at a time through a {self.kv} KV cache" if self.chunk else ""
        return (f"{self.data}, tokenizer {self.tokenizer}, {self.windows} x {self.window}-token windows "
                f"({overlap}, {bos}), {self.scored_tokens} tokens scored (all after each window's first){feed}")

    def to_dict(self) -> dict:
        return {**asdict(self), "text": self.describe()}
