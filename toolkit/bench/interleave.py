"""The order every side-by-side benchmark runs its paths in: this machine is noisy, so only ratios measured in
one run mean anything, and the paths take turns going first so neither always meets a warmer (or busier) CPU."""

from collections.abc import Callable, Iterator


def interleaved(paths: dict[str, Callable], prompts: list, repeats: int, warmup: int) -> Iterator[tuple[int, str,
                                                                                                        object]]:
    """Run each path `warmup` times on the first prompt (untimed), then yield (repeat, path name, prompt) for
    every repeat and prompt, the paths alternating which goes first; the caller runs and records each."""
    for run in paths.values():
        for ids in prompts[:1] * warmup:
            run(ids)
    for rep in range(repeats):
        for i, ids in enumerate(prompts):
            for name in list(paths) if (rep + i) % 2 == 0 else list(reversed(paths)):
                yield rep, name, ids
