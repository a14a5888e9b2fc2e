"""The toolkit's own errors: each names what is wrong, where (file and row, or the CLI setting) and the fix.

    raise ConfigError("data.max_length", "must be >= 2, got 1", "raise it")   # data.max_length: must be >= 2, ...

Every class derives from `LitPackingError` (a `ValueError`), which `python main.py` prints alone, without a
traceback, before exiting with status 2. Catch `LitPackingError` to handle any of them.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping

_SETTING_REF = re.compile(r"\{([A-Za-z_][\w.\[\]]*)\}")  # `{max_tokens}` in a message: a setting


class LitPackingError(ValueError):
    """Base of every error the toolkit raises on purpose: the message alone says what to change."""


class ConfigError(LitPackingError):
    """A setting out of range or impossible here, raised when the objects are built (before any data or model).

    The core (samplers, collators, attention, loss) names its own parameters (`max_tokens`); the Lightning layer
    that built the object from a config says where that parameter lives (`under`), so the same error reads
    `max_tokens: ...` to a plain PyTorch user and `data.sampler.init_args.max_tokens: ...` on the command line.
    Other settings are referred to in `problem` and `fix` as `{name}`, rendered the same way.

    Args:
        setting: the parameter, e.g. `max_tokens`, or a full CLI path such as `data.max_length`.
        problem: what is wrong with its value, e.g. `must be >= 1, got 0`.
        fix: what to set instead (optional).

    >>> error = ConfigError("max_tokens", "must be >= 1, got 0", "or lower {max_length}")
    >>> str(error)
    'max_tokens: must be >= 1, got 0; or lower max_length'
    >>> str(error.under({"max_tokens": "data.sampler.init_args.max_tokens", "max_length": "data.max_length"}))
    'data.sampler.init_args.max_tokens: must be >= 1, got 0; or lower data.max_length'
    """

    def __init__(self, setting: str, problem: str, fix: str = "", paths: Mapping[str, str] | None = None) -> None:
        self.setting, self.problem, self.fix = setting, problem, fix
        self.paths = dict(paths or {})
        self.path = self.paths.get(setting, setting)  # where the setting lives for whoever reads the message
        render = functools.partial(_SETTING_REF.sub, lambda m: self.paths.get(m[1], m[1]))
        super().__init__(f"{self.path}: {render(problem)}" + (f"; {render(fix)}" if fix else ""))

    def under(self, paths: Mapping[str, str]) -> ConfigError:
        """The same error with settings named by `paths` (parameter -> where it is set); others keep their name."""
        return type(self)(self.setting, self.problem, self.fix, {**self.paths, **paths})


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


class AssetError(ConfigError, FileNotFoundError):
    """A packaged asset (model, tokenizer, data file), a local path or a Hub name that is not where the setting says:
    named before anything is downloaded, so a typo never becomes a Hub request."""


class IsolationError(LitPackingError):
    """Packed examples are not isolated from each other (or the packed batch is malformed)."""


class StepMemoryError(LitPackingError, MemoryError):
    """The predicted peak memory of the largest step exceeds what the device has (printed alone by the CLI)."""


def install_hint(extra: str) -> str:
    """The command that adds an optional extra of pyproject.toml: lit_packing installs from a clone of its repository
    (or a wheel built from one), not from a package index, so the hint names those two ways.

    >>> print(install_hint("qlora"))  # doctest: +NORMALIZE_WHITESPACE
    pip install -e ".[qlora]" at the root of your lit_packing clone,
    or pip install "<wheel>[qlora]" with a wheel built from it
    """
    return (
        f'pip install -e ".[{extra}]" at the root of your lit_packing clone, '
        f'or pip install "<wheel>[{extra}]" with a wheel built from it'
    )


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
