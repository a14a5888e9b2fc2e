"""The tokenization report: what tokenization kept, cut and dropped, counted from the tokenized rows' columns.

    report = report_of(lambda name: column(mapped, name)); check_report(report, "error", "truncate", 2048)

`report_of` counts a mapped Dataset's columns (the cached path) or a streamed chunk's (the stream) the same way;
`check_report` raises the `DataError` the `on_bad_row` / `overlong` policies ask for, naming the first rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import numpy as np

from lit_packing.batch import TRUNCATED_TOKENS
from lit_packing.data.encode import DROPPED, LABEL_TOKENS, LENGTH, ROW, TOKEN_HASH
from lit_packing.data.shapes import PROBLEM
from lit_packing.errors import DataError
from lit_packing.text import count

SAMPLES = 5  # offending rows named per kind, in messages and reports


@dataclass
class TokenizationReport:
    """What tokenization kept, cut and dropped; nothing is dropped without being counted here.

    `tokens_in == real_tokens + truncated_tokens + dropped_overlong_tokens + dropped_no_label_tokens` and
    `examples_in == examples_out + bad_examples + dropped_overlong_examples + dropped_no_label_examples`
    (bad rows are never tokenized). `duplicate_examples` counts kept examples whose tokens equal an earlier one's.
    `samples` names the first few rows of each kind: `{"bad": [(row, problem), ...], "overlong": ...}`.
    """

    examples_in: int = 0
    examples_out: int = 0
    tokens_in: int = 0
    real_tokens: int = 0
    label_tokens: int = 0
    truncated_examples: int = 0
    truncated_tokens: int = 0
    dropped_overlong_examples: int = 0
    dropped_overlong_tokens: int = 0
    dropped_no_label_examples: int = 0
    dropped_no_label_tokens: int = 0
    bad_examples: int = 0
    duplicate_examples: int = 0
    samples: dict[str, list[tuple[int, str]]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        """Plain ints for loggers (`logger.log_hyperparams({"data": report.as_dict()})`)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "samples"}

    def update(self, other: TokenizationReport) -> None:
        """Add `other`'s counts to these, in place (a stream's report grows as its chunks are tokenized)."""
        total = self + other
        for name, value in vars(total).items():
            setattr(self, name, value)

    def __add__(self, other: TokenizationReport) -> TokenizationReport:
        kinds = {**self.samples, **other.samples}
        samples = {k: (self.samples.get(k, []) + other.samples.get(k, []))[:SAMPLES] for k in kinds}
        return TokenizationReport(**{k: v + getattr(other, k) for k, v in self.as_dict().items()}, samples=samples)

    def __str__(self) -> str:
        return (
            f"tokenized {count(self.examples_in, 'example')} -> kept {self.examples_out:,} "
            f"({count(self.real_tokens, 'token')}, {self.label_tokens:,} trained); "
            f"skipped {count(self.bad_examples, 'bad row')}; "
            f"truncated {self.truncated_examples:,} ({count(self.truncated_tokens, 'token')} cut); "
            f"dropped {self.dropped_overlong_examples:,} overlong ({count(self.dropped_overlong_tokens, 'token')}) "
            f"and {self.dropped_no_label_examples:,} with no trained token "
            f"({count(self.dropped_no_label_tokens, 'token')}); {count(self.duplicate_examples, 'duplicate')} kept"
        )

    def named(self, kind: str, row_name: Callable[[int], str] = "row {:,}".format) -> str:
        """The first rows of one kind, e.g. `line 3 of a.jsonl (messages is null); line 9 of a.jsonl (...)`."""
        return "; ".join(
            f"{row_name(row)}" + (f" ({detail})" if detail else "") for row, detail in self.samples.get(kind, [])
        )


def _samples(where: np.ndarray, rows: np.ndarray, details: np.ndarray | None = None) -> list[tuple[int, str]]:
    first = np.flatnonzero(where)[:SAMPLES]
    return [(int(rows[i]), str(details[i]) if details is not None else "") for i in first]


def report_of(read: Callable[[str], np.ndarray]) -> TokenizationReport:
    """The report of tokenized rows, each column given by `read(name)` (a mapped dataset's column, or a streamed
    chunk's); duplicates are counted among these rows."""
    length, cut = read(LENGTH).astype(np.int64), read(TRUNCATED_TOKENS).astype(np.int64)
    trained, dropped = read(LABEL_TOKENS).astype(np.int64), read(DROPPED)
    rows, problems, hashes = read(ROW), read(PROBLEM), read(TOKEN_HASH)
    kept, overlong, unlabelled, bad = dropped == "", dropped == "overlong", dropped == "no_labels", dropped == "bad"
    duplicate = np.zeros(len(length), dtype=bool)
    _, first = np.unique(hashes[kept], return_index=True)
    duplicate[np.flatnonzero(kept)] = True
    duplicate[np.flatnonzero(kept)[first]] = False
    return TokenizationReport(
        examples_in=len(length),
        examples_out=int(kept.sum()),
        tokens_in=int((length + cut).sum()),
        real_tokens=int(length[kept].sum()),
        label_tokens=int(trained[kept].sum()),
        truncated_examples=int((kept & (cut > 0)).sum()),
        truncated_tokens=int(cut[kept].sum()),
        dropped_overlong_examples=int(overlong.sum()),
        dropped_overlong_tokens=int(length[overlong].sum()),
        dropped_no_label_examples=int(unlabelled.sum()),
        dropped_no_label_tokens=int((length + cut)[unlabelled].sum()),
        bad_examples=int(bad.sum()),
        duplicate_examples=int(duplicate.sum()),
        samples={
            kind: found
            for kind, found in (
                ("bad", _samples(bad, rows, problems)),
                ("overlong", _samples(overlong, rows, problems)),
                ("no_labels", _samples(unlabelled, rows)),
                ("duplicate", _samples(duplicate, rows)),
            )
            if found
        },
    )


def check_report(
    report: TokenizationReport,
    on_bad_row: str,
    overlong: str,
    max_length: int,
    row_name: Callable[[int], str] = "row {:,}".format,
) -> None:
    """Raise the `DataError` the policies ask for: bad rows under `error`, overlong rows under `error`, or nothing
    left to train on; each names the first rows and the setting to change."""
    bad, long = report.samples.get("bad", []), report.samples.get("overlong", [])
    if bad and on_bad_row == "error":
        raise DataError(
            f"{report.bad_examples:,} bad rows, first {report.named('bad', row_name)}: fix them, or set "
            f"data.on_bad_row=skip to leave them out (they are counted)",
            rows=[row for row, _ in bad],
        )
    if long and overlong == "error":
        raise DataError(
            f"{report.dropped_overlong_examples:,} examples over max_length={max_length:,}, first "
            f"{report.named('overlong', row_name)}: raise data.max_length or set data.overlong=truncate (or drop)",
            rows=[row for row, _ in long],
        )
    if not report.examples_out:
        raise DataError(
            f"nothing to train on: no example of {report.examples_in:,} is left ({report}): check the source's "
            f"fields (data.source), data.max_length with data.overlong, data.train_on and data.on_bad_row"
        )
