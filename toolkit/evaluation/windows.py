"""Held-out text -> token windows for perplexity, KL and top-1 agreement.

The documents are joined by blank lines and tokenised once (no special tokens), then cut into consecutive,
non-overlapping runs of `window - 1` text tokens, each preceded by the BOS token (a window then looks like the
start of a document, as in training, and every window is scored the same way). Without a BOS token in the
tokenizer, windows hold `window` text tokens and nothing is prepended. A trailing partial window is dropped."""

import torch

from toolkit.errors import DataError, InputError
from toolkit.evaluation.protocol import WindowProtocol


def bos_token_id(tokenizer) -> int | None:
    return tokenizer.bos_token_id


def make_windows(tokenizer, texts: list[str], window: int = 512, max_windows: int | None = None,
                 data: str = "text") -> tuple[torch.Tensor, WindowProtocol]:
    """[n, window] token ids and the protocol that describes them."""
    if window < 2:
        raise InputError(f"window={window} is too short", "use window >= 2 (512 is the default)")
    bos = bos_token_id(tokenizer)
    body = window - (bos is not None)
    ids = tokenizer("\n\n".join(texts), add_special_tokens=False).input_ids
    n = len(ids) // body
    if max_windows:
        n = min(n, max_windows)
    if n == 0:
        raise DataError(f"{data} has {len(ids)} tokens, fewer than one window of {body}",
                        "use a smaller window= or more text")
    rows = torch.tensor(ids[:n * body], dtype=torch.long).view(n, body)
    if bos is not None:
        rows = torch.cat([torch.full((n, 1), bos, dtype=torch.long), rows], dim=1)
    name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__).rstrip("/").rsplit("/", 1)[-1]
    protocol = WindowProtocol(tokenizer=name,
                              data=data, window=window, stride=body, bos_token_id=bos, windows=n,
                              scored_tokens=n * (window - 1))
    return rows, protocol
