"""`Mixture`: several sources trained at chosen proportions of their real tokens.

    source:
      class_path: lit_packing.data.Mixture
      init_args:
        sources: [{class_path: lit_packing.data.ChampChats}, {class_path: lit_packing.data.Chatterbot}]
        weights: [0.7, 0.3]          # shares of the trained tokens (or examples: weight_by: examples)

A mixture is read as a stream (`data.streaming: true`, see `lit_packing.data.stream`): the next example always
comes from the source furthest below its share of what was trained so far, a deterministic largest-deficit rule,
so the shares hold in every window of `data.buffer_size` examples to within one example, not only on average.
"""

from __future__ import annotations

from typing import Literal

import datasets

from lit_packing.data.sources import Source
from lit_packing.data.stream import Member
from lit_packing.errors import ConfigError


class Mixture(Source):
    """Several sources, each given a share of the trained tokens.

    Args:
        sources: the sources, each any `lit_packing.data` source (a `Mixture` too).
        weights: their shares (any positive numbers, normalised to sum to 1); None: equal shares.
        names: their names in logs and metrics (`train/source_share/<name>`); None: the class names, lower case,
            numbered where two are of the same class.
        weight_by: `tokens` (the shares are of real tokens, every token a step computes) or `examples`.
        on_exhausted: when a source has no example left in the epoch: `stop` ends the epoch there (the shares held
            up to that point; the other sources' unread rows wait for the next epoch), `repeat` reads that source
            again (its next pass, shuffled anew) until every source has been read through once.
    """

    def __init__(
        self,
        sources: list[Source],
        weights: list[float] | None = None,
        names: list[str] | None = None,
        weight_by: Literal["tokens", "examples"] = "tokens",
        on_exhausted: Literal["stop", "repeat"] = "stop",
    ) -> None:
        if not sources:
            raise ConfigError("data.source.init_args.sources", "a Mixture needs at least one source")
        weights = [1.0] * len(sources) if weights is None else [float(w) for w in weights]
        if len(weights) != len(sources) or min(weights) <= 0:
            raise ConfigError(
                "data.source.init_args.weights",
                f"{weights} for {len(sources)} sources: give one positive weight per source",
            )
        if names is None:
            kinds = [type(s).__name__.lower() for s in sources]
            names = [k if kinds.count(k) == 1 else f"{k}{kinds[:i].count(k)}" for i, k in enumerate(kinds)]
        if len(names) != len(sources) or len(set(names)) != len(names):
            raise ConfigError("data.source.init_args.names", f"{names}: give one distinct name per source")
        if weight_by not in ("tokens", "examples"):
            raise ConfigError("data.source.init_args.weight_by", f"{weight_by!r} is not one of: tokens, examples")
        if on_exhausted not in ("stop", "repeat"):
            raise ConfigError("data.source.init_args.on_exhausted", f"{on_exhausted!r} is not one of: stop, repeat")
        self.sources = sources
        self.weights = weights
        self.names = names
        self.weight_by = weight_by
        self.on_exhausted = on_exhausted

    def members(self) -> list[Member]:
        """The sources with their names and weights."""
        return [Member(name, source, weight) for name, source, weight in zip(self.names, self.sources, self.weights)]

    @property
    def fingerprint(self) -> str:
        return "Mixture-" + "-".join(s.fingerprint for s in self.sources)

    def shards(self) -> list:
        raise ConfigError(
            "data.source",
            "a Mixture's shards are its sources' (the stream reads each source itself)",
            "use it with data.streaming=true",
        )

    def load(self, cache_dir: str | None = None) -> datasets.Dataset:
        raise ConfigError(
            "data.streaming",
            "a Mixture is read as a stream: its shares are kept window by window as the examples are tokenized",
            "set data.streaming=true (with data.buffer_size)",
        )

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={w:g}" for n, w in zip(self.names, self.weights))
        return f"Mixture({parts}, weight_by={self.weight_by})"
