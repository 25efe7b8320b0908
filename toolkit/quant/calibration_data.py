"""Calibration data: deterministic token windows cut from a dataset's *calibration* split (never the evaluation
split), what the data-dependent quantizers (GPTQ, AWQ) and scale tuning run on."""

from __future__ import annotations

import os

import torch

from toolkit.data import CALIBRATION, load_text
from toolkit.data.chat import CHAT, DOMAINS, MIX, domain_texts, fetch_domains

__all__ = ["calibration_batches"]


def _tokenizer_adds_bos(tokenizer) -> bool:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer("a")["input_ids"]
    return len(ids) > 0 and ids[0] == bos


def calibration_batches(tokenizer, dataset="pydoc", n_samples: int = 128, seq_len: int = 512, seed: int = 0,
                        add_bos: bool | None = None) -> torch.LongTensor:
    """``[n_samples, seq_len]`` token windows from the calibration split of ``dataset``, deterministically.

    ``dataset`` is a dataset name or path for `toolkit.data.load_text` (its ``"calibration"`` split), ``chat``
    (conversations rendered with the tokenizer's chat template, toolkit/data/chat.py), ``mix`` (the default: prose,
    docs, code and chat, `DOMAINS`), several joined by ``+`` (``"pydoc+austen"``: a mix, window i taken from source ``i % n`` so every prefix of the
    windows, e.g. AWQ's search samples, holds each source about equally; each source's windows are drawn as if it
    were calibrated alone), or already-loaded texts (a ``datasets.Dataset`` with a ``text`` column, or a list of
    strings). The documents are tokenized without special tokens and concatenated (separated by EOS when the
    tokenizer has one); window starts are drawn with a ``torch.Generator`` seeded with ``seed``. With BOS
    (``add_bos=True``, or ``add_bos=None`` and the tokenizer adds one by default) every window is ``[bos] +
    seq_len - 1 tokens``.
    """
    if n_samples < 1 or seq_len < 2:
        raise ValueError(f"need n_samples >= 1 and seq_len >= 2, got {n_samples}, {seq_len}")
    if dataset == MIX:
        fetch_domains()
        dataset = "+".join(DOMAINS.values())
    if isinstance(dataset, str) and "+" in dataset:
        names = [name.strip() for name in dataset.split("+")]
        if any(not name for name in names) or len(set(names)) != len(names):
            raise ValueError(f"a calibration mix names each dataset once, joined by '+' (e.g. pydoc+austen); got "
                             f"{dataset!r}")
        n = len(names)  # window i is window i // n of source i % n, which gives len(range(s, n_samples, n)) of them
        parts = [calibration_batches(tokenizer, name, len(range(s, n_samples, n)), seq_len, seed, add_bos)
                 if s < n_samples else None for s, name in enumerate(names)]
        return torch.stack([parts[i % n][i // n] for i in range(n_samples)])
    if dataset == CHAT:
        texts = domain_texts(CHAT, CALIBRATION, tokenizer)
    elif isinstance(dataset, (str, os.PathLike)):
        texts = load_text(dataset, split=CALIBRATION)["text"]
    elif hasattr(dataset, "column_names"):
        texts = dataset["text"]
    else:
        texts = list(dataset)
    if add_bos is None:
        add_bos = _tokenizer_adds_bos(tokenizer)
    if add_bos and getattr(tokenizer, "bos_token_id", None) is None:
        raise ValueError("add_bos=True but the tokenizer has no BOS token")
    eos = getattr(tokenizer, "eos_token_id", None)
    stream: list[int] = []
    for text in texts:
        if not text:
            continue
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if eos is not None:
            stream.append(eos)
    body = seq_len - 1 if add_bos else seq_len
    if len(stream) < body:
        raise ValueError(f"the calibration text has {len(stream)} tokens, fewer than one window of {body}")
    tokens = torch.tensor(stream, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - body + 1, (n_samples,), generator=generator)
    windows = torch.stack([tokens[s:s + body] for s in starts.tolist()])
    if add_bos:
        windows = torch.cat([torch.full((n_samples, 1), tokenizer.bos_token_id, dtype=torch.long), windows], 1)
    return windows
