"""The reference model's per-item cloze / multiple-choice scores, computed once and kept on disk.

A sweep evaluates many candidates (weights x KV cache) against one reference, the float model in fp32: scoring
the reference again for each would double the cost of cloze and mc. Its scores are stored under
`$SPECQUANT_HOME/eval-items/reference-scores/<key>.json`, where the key hashes everything they depend on: the
reference's weights (every tensor's name, dtype, shape and bytes, xxh3), the encoded rows, the batch size (padding
changes floating-point sums), the scorer's version and torch's. A file is written atomically with a sha256 of its
scores, checked on load; a damaged one is scored again and replaced."""

import hashlib
import json
import sys

import torch
import xxhash

from toolkit.evaluation.continuation import encode_pairs, score_continuations
from toolkit.evaluation.items import items_dir
from toolkit.fileio import write_json_atomic
from toolkit.kv import KVSpec

SCORER_VERSION = 2  # bump when toolkit.evaluation.continuation changes what it computes


def weights_fingerprint(model) -> str:
    digest = xxhash.xxh3_128()
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        if tensor.numel():  # the bytes as they are (no copy beyond making them contiguous on the CPU)
            digest.update(memoryview(tensor.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy()))
    return digest.hexdigest()


def scores_key(model, encoded: list, batch_size: int, task: str) -> str:
    head = {"task": task, "scorer": SCORER_VERSION, "torch": torch.__version__, "batch_size": batch_size,
            "weights": weights_fingerprint(model)}
    digest = hashlib.sha256(json.dumps(head, sort_keys=True).encode())
    digest.update(json.dumps(encoded).encode())
    return digest.hexdigest()


def _checksum(scores: list[dict]) -> str:
    return hashlib.sha256(json.dumps(scores, sort_keys=True).encode()).hexdigest()


def cached_reference_scores(model, encoded: list, batch_size: int, task: str, score) -> tuple[list[dict], bool]:
    """(the scores `score()` returns for the reference, whether they came from the disk cache)."""
    key = scores_key(model, encoded, batch_size, task)
    path = items_dir() / "reference-scores" / f"{task}-{key[:24]}.json"
    if path.is_file():
        try:
            stored = json.loads(path.read_text())
            if stored["key"] == key and stored["sha256"] == _checksum(stored["scores"]):
                return stored["scores"], True
        except (OSError, ValueError, KeyError):
            pass
        print(f"reference scores {path} are damaged: scoring the reference again", file=sys.stderr)
    scores = score()
    write_json_atomic(path, {"task": task, "key": key, "rows": len(scores), "sha256": _checksum(scores),
                             "scores": scores})
    return scores, False


def score_pairs(model, tokenizer, pairs: list[tuple[str, str]], reference, max_context: int, batch_size: int,
                kv: KVSpec | None, progress, task: str) -> tuple[list[dict], list[dict], bool]:
    """(the model's scores of each (context, continuation) pair, the reference's -- the model's own without a
    reference --, whether the reference's came from the disk cache): what cloze and multiple choice both score."""
    encoded = encode_pairs(tokenizer, pairs, max_context)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    got = score_continuations(model, encoded, pad, batch_size, kv, progress)
    if reference is None:
        return got, got, False
    ref, stored = cached_reference_scores(reference, encoded, batch_size, task, lambda: score_continuations(
        reference, encoded, pad, batch_size, progress=progress))
    return got, ref, stored
