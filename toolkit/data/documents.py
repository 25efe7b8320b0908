"""The record every text source yields, and the paragraph cut that splitting, files and prompts all share."""

import re
from typing import NamedTuple


class Document(NamedTuple):
    title: str
    text: str
    key: str  # what decides the split: a topic, a file path, a novel


def paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks, stripped, empty ones dropped."""
    return [block.strip() for block in re.split(r"\n\s*\n", text) if block.strip()]
