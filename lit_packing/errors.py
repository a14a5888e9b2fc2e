"""The toolkit's own errors: each names what is wrong, where (file and row, or the CLI setting) and the fix.

    raise ConfigError("data.max_length", "must be >= 2, got 1", "raise it")   # data.max_length=1: must be ...

Every class derives from `LitPackingError` (a `ValueError`), which `python main.py` prints alone, without a
traceback, before exiting with status 2. Catch `LitPackingError` to handle any of them.
"""

from __future__ import annotations

import math


class LitPackingError(ValueError):
    """Base of every error the toolkit raises on purpose: the message alone says what to change."""


class ConfigError(LitPackingError):
    """A setting out of range or impossible here, raised when the objects are built (before any data or model).

    Args:
        setting: the full CLI path, e.g. `data.sampler.init_args.max_tokens`.
        problem: what is wrong with its value, e.g. `must be >= 1, got 0`.
        fix: what to set instead (optional).
    """

    def __init__(self, setting: str, problem: str, fix: str = "") -> None:
        self.setting, self.problem, self.fix = setting, problem, fix
        super().__init__(f"{setting}: {problem}" + (f"; {fix}" if fix else ""))


class DataError(LitPackingError):
    """Examples that cannot be trained as asked: bad rows, nothing left to train on, a damaged cache.

    Attributes:
        rows: the offending rows as the user counts them (line numbers of a JSONL file, else source rows), first few.
    """

    def __init__(self, message: str, rows: list[int] | None = None) -> None:
        self.rows = list(rows or [])
        super().__init__(message)


class TrainingError(LitPackingError):
    """The run cannot go on or did not train: a non-finite loss or gradient, no optimizer step taken."""


def check_range(setting: str, value: float | None, low: float | None = None, high: float | None = None,
                *, low_open: bool = False, high_open: bool = False) -> None:  # fmt: skip
    """Raise a `ConfigError` naming `setting` unless `low <= value <= high` (`*_open`: strict); None passes.

    `check_range("model.lr", 0.0, 0, low_open=True)` -> `model.lr: must be > 0, got 0.0`.
    """
    if value is None:
        return
    if not math.isfinite(value):
        raise ConfigError(setting, f"must be a finite number, got {value}")
    if low is not None and (value <= low if low_open else value < low):
        raise ConfigError(setting, f"must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and (value >= high if high_open else value > high):
        raise ConfigError(setting, f"must be {'<' if high_open else '<='} {high}, got {value}")
