"""The packaged configs, addressable by name: `--config quickstart` is this folder's `quickstart.yaml`.

    python main.py fit --config paper --config padding     # = --config configs/paper.yaml --config configs/padding.yaml

Whole configs run alone (`quickstart`, `gpu`, `paper`); a delta holds only what makes it a variant and runs after
its base (`DELTAS`): jsonargparse merges the `--config` files in order, later values winning. A `--config` value
that is not an existing file and has no path separator names a packaged config (with or without `.yaml`).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from lit_packing.errors import ConfigError

FOLDER = Path(__file__).parent
# Each delta and the base it goes on: `--config <base> --config <delta>`.
DELTAS: dict[str, str] = {
    "padding": "paper",
    "minibatch_packing": "paper",
    "fixed_packing_no_position_ids": "paper",
    "fixed_packing_position_ids": "paper",
    "bestfit_packing": "paper",
    "multipack": "paper",
    "fsdp2": "paper",
    "context_parallel": "paper",
    "multinode": "gpu",
}
# Layers that go on top of whole configs in either order: `--config gpu --config dpo` runs as `--config dpo --config
# gpu` (gpu.yaml's device, precision and sizes win over an objective's CPU-sized values; said in one line).
ON_TOP: dict[str, tuple[str, ...]] = {"gpu": ("dpo", "grpo", "grpo_replay", "qlora", "vlm")}
_NAME = re.compile(r"[\w.-]+")  # a bare name; anything else (a path, an inline YAML string) is left to jsonargparse


def names() -> list[str]:
    """The packaged configs' names, sorted: `quickstart`, `paper`, `padding`, ..."""
    return sorted(path.stem for path in FOLDER.glob("*.yaml"))


def config_path(name: str) -> Path:
    """The packaged file of a config name (`quickstart` or `quickstart.yaml`).

    Raises:
        ConfigError: no packaged config has that name; the message lists the names there are.
    """
    stem = name.removesuffix(".yaml")
    path = FOLDER / f"{stem}.yaml"
    if not _NAME.fullmatch(stem) or not path.is_file():
        problem = f"{name!r} is neither a file nor a packaged config"
        raise ConfigError("--config", problem, f"give a path, or one of: {', '.join(names())}")
    return path


def describe(name: str) -> str:
    """The first sentence of a packaged config's header comment (what `lit-packing configs` prints)."""
    header = []
    for line in config_path(name).read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip())
    return " ".join(header).split(". ")[0].rstrip(".") + "."


def composition(name: str) -> list[Path]:
    """The files a packaged config runs as, in `--config` order: `[paper.yaml, padding.yaml]` for a delta, else
    `[quickstart.yaml]`."""
    stem = name.removesuffix(".yaml")
    base = DELTAS.get(stem)
    return [*([config_path(base)] if base else []), config_path(stem)]


def config_args(name: str) -> list[str]:
    """`composition(name)` as arguments: `["--config", ".../paper.yaml", "--config", ".../padding.yaml"]`."""
    return [arg for path in composition(name) for arg in ("--config", str(path))]


def _packaged_delta(value: str) -> str | None:
    """The name of the packaged delta `value` points at (by name or by path), else None."""
    path = Path(value)
    if path.is_file():
        if path.resolve().parent != FOLDER.resolve():
            return None
        stem = path.stem
    else:
        stem = value.removesuffix(".yaml")
    return stem if stem in DELTAS else None


def resolve_config_args(args: list[str] | None = None) -> list[str]:
    """Replace every `--config NAME` (`--config=NAME`, `-c NAME`) naming a packaged config by that config's path.

    With `args=None` the process's own `sys.argv[1:]` is rewritten in place (as `main.py` and the `lit-packing`
    command run) and returned; a list is returned rewritten, itself unchanged.

    Raises:
        ConfigError: an unknown name, or a packaged delta given first (it holds only what differs from its base).
    """
    argv = sys.argv[1:] if args is None else list(args)
    configs: list[int] = []  # positions of the --config values
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            argv[i] = "--config=" + _resolve(arg.removeprefix("--config="))
            configs.append(i)
        elif arg in ("--config", "-c") and i + 1 < len(argv):
            argv[i + 1] = _resolve(argv[i + 1])
            configs.append(i + 1)
    _put_layers_on_top(argv, configs)
    if configs:
        first = argv[configs[0]].removeprefix("--config=")
        delta = _packaged_delta(first)
        if delta is not None:
            raise ConfigError(
                "--config",
                f"{delta} holds only what makes its variant and runs on top of {DELTAS[delta]}",
                f"use --config {DELTAS[delta]} --config {delta}",
            )
    if args is None:
        sys.argv[1:] = argv
    return argv


def _packaged_name(value: str) -> str | None:
    """The packaged config a resolved `--config` value is (its stem), else None."""
    path = Path(value.removeprefix("--config="))
    return path.stem if path.is_file() and path.resolve().parent == FOLDER.resolve() else None


def _put_layers_on_top(argv: list[str], configs: list[int]) -> None:
    """Move each config an `ON_TOP` layer goes on (an objective's) from after the layer to just before it, in place:
    `--config gpu --config dpo` -> `--config dpo --config gpu`. `configs` holds the positions of the values."""
    for layer, bases in ON_TOP.items():
        at = next((i for i in configs if _packaged_name(argv[i]) == layer), None)
        for i in [i for i in configs if at is not None and i > at and _packaged_name(argv[i]) in bases]:
            name, start = _packaged_name(argv[i]), i if argv[i].startswith("--config=") else i - 1
            pair = argv[start : i + 1]
            del argv[start : i + 1]
            layer_start = at if argv[at].startswith("--config=") else at - 1
            argv[layer_start:layer_start] = pair
            at += len(pair)
            print(f"note: --config {name} runs before --config {layer} ({layer}.yaml's device, precision and sizes "
                  f"go on top of {name}.yaml's)", file=sys.stderr)  # fmt: skip
    configs[:] = [i for i, arg in enumerate(argv) if arg.startswith("--config=") or (
        i > 0 and argv[i - 1] in ("--config", "-c"))]  # fmt: skip


def _resolve(value: str) -> str:
    """A `--config` value: an existing file, a path or an inline YAML string unchanged; a name as its packaged path
    (also where a folder of that name is in the way: a run's, `runs/quickstart` under `default_root_dir: .`)."""
    if Path(value).is_file() or not _NAME.fullmatch(value):
        return value
    return str(config_path(value))
