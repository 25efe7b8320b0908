"""What the scripts' command lines share: the docstring's first paragraph as the description, and --model."""

import argparse

DEFAULT_MODEL = "smollm2-135m"


def parser(doc: str, model: str | None = DEFAULT_MODEL) -> argparse.ArgumentParser:
    """A script's parser, with `--model` (registry name or directory, default `model`) unless model is None."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if model is not None:
        p.add_argument("--model", default=model, help="registry name or directory")
    return p
