"""Hugging Face hub datasets, "org/name" or "org/name:config": online only, so an offline run says what to use."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from toolkit.data.documents import Document
from toolkit.data.splits import CALIBRATION, EVALUATION, OTHER, hash_split, to_splits
from toolkit.errors import DataError

if TYPE_CHECKING:  # `datasets` takes a second to import; only the functions that build datasets pay for it
    import datasets

_HUB_NAME = re.compile(r"^[\w.-]+/[\w.-]+(:[\w.-]+)?$")


def is_hub_name(source: str) -> bool:
    return _HUB_NAME.match(source) is not None


def _hub_offline() -> bool:
    return any(os.environ.get(var, "").strip().upper() in {"1", "ON", "YES", "TRUE"}
               for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_splits(source: str, offline_datasets: Iterable[str]) -> datasets.DatasetDict:
    """The hub dataset's own splits, not regrouped; `offline_datasets` are suggested when the hub is off."""
    import datasets

    if _hub_offline():
        raise DataError(f"{source} is a Hugging Face hub dataset, but the hub is off (HF_HUB_OFFLINE=1)",
                        fix=f"unset HF_HUB_OFFLINE to download it, or use an offline dataset: "
                            f"{', '.join(offline_datasets)}")
    repo, _, config = source.partition(":")
    try:
        raw = datasets.load_dataset(repo, config or None)
    except Exception as e:  # the hub client raises many types; all mean the same thing to the user
        raise DataError(f"could not load hub dataset {source}: {e}",
                        fix="check the name (org/name[:config]) and the network") from None
    # train calibrates; validation (else test) evaluates. A lone split is divided by a stable hash of row index.
    held_out = next((s for s in ("validation", "test") if s in raw), None)
    docs = []
    for split, rows in raw.items():
        if "text" not in rows.column_names:
            raise DataError(f"{source} split {split} has no column \"text\" (it has {', '.join(rows.column_names)})",
                            fix="use a dataset with a text column")
        titles = rows["title"] if "title" in rows.column_names else [f"{source}/{split}/{i}" for i in range(len(rows))]
        docs += [Document(str(t), x, f"{split}/{i}") for i, (t, x) in enumerate(zip(titles, rows["text"])) if x]

    def split_of(key: str) -> str:
        if held_out is None:
            return hash_split(key)
        return {"train": CALIBRATION, held_out: EVALUATION}.get(key.split("/")[0], OTHER)

    return to_splits(docs, [split_of(doc.key) for doc in docs])
