"""A progress bar on stderr for a job of a few named stages (a fetch), or nothing when it is turned off."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def stage_progress(title: str, stages: int, enabled: bool) -> Iterator[Callable[[str], None]]:
    """Yield stage(description): each call shows the next stage of the job."""
    if not enabled:
        yield lambda description: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = (SpinnerColumn(), TextColumn(f"[bold]{title}[/] {{task.description}}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("", total=stages)
        done = iter(range(stages))
        yield lambda description: bar.update(task, completed=next(done, stages), description=description)
        bar.update(task, completed=stages, description="done")
