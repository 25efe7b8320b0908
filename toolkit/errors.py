"""User-facing errors: each names the problem and the fix, so the CLI can print one clear line and exit."""


class SpecquantError(Exception):
    """An error a user can act on. `fix` says what to do about it."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(problem if not fix else f"{problem}\n  fix: {fix}")


class ModelError(SpecquantError):
    """A model could not be found, fetched, converted or loaded."""


class DataError(SpecquantError):
    """A dataset or file could not be found, fetched or read."""


class InputError(SpecquantError):
    """A request the engine cannot serve as given (empty prompt, too long, bad sampling settings)."""
