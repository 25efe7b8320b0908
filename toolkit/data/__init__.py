"""The text layer: named offline datasets with disjoint calibration/evaluation splits, and benchmark prompt sets."""

from toolkit.data.prompts import PROMPT_SETS, Prompt, build_prompts
from toolkit.data.sources import (
    CALIBRATION,
    DATASETS,
    EVALUATION,
    SourceSpec,
    fetch,
    is_cached,
    list_datasets,
    load_splits,
    load_text,
)

__all__ = [
    "CALIBRATION", "DATASETS", "EVALUATION", "PROMPT_SETS", "Prompt", "SourceSpec", "build_prompts", "fetch",
    "is_cached", "list_datasets", "load_splits", "load_text",
]
