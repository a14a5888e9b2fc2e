"""Fixed-length rows: exact slices on a worked example and equality with a token-by-token reference."""

from __future__ import annotations

import numpy as np
import pytest

from lit_packing.samplers import FixedLengthPackingSampler, fixed_length_rows


def reference_rows(sizes: list[int], max_tokens: int, drop_last: bool) -> list[list[tuple[int, int, int]]]:
    """Walk the stream token by token, cutting a row every ``max_tokens`` tokens."""
    tokens = [(i, t) for i, size in enumerate(sizes) for t in range(size)]
    rows = [tokens[s : s + max_tokens] for s in range(0, len(tokens), max_tokens)]
    if drop_last and rows and len(rows[-1]) < max_tokens:
        rows.pop()
    out = []
    for row in rows:
        pieces: list[tuple[int, int, int]] = []
        for i, t in row:
            if pieces and pieces[-1][0] == i:
                pieces[-1] = (i, pieces[-1][1], t + 1)
            else:
                pieces.append((i, t, t + 1))
        out.append(pieces)
    return out


def test_worked_example():
    sampler = FixedLengthPackingSampler([5, 3, 6], max_tokens=4, shuffle=False)
    expected = [[(0, 0, 4)], [(0, 4, 5), (1, 0, 3)], [(2, 0, 4)], [(2, 4, 6)]]
    assert sampler.plan().packs() == expected
    assert list(sampler) == expected
    short = FixedLengthPackingSampler([5, 3, 6], max_tokens=4, shuffle=False, drop_last=True)
    assert list(short) == expected[:3]


@pytest.mark.parametrize("drop_last", [False, True])
def test_matches_token_by_token_reference(drop_last):
    rng = np.random.default_rng(3)
    for _ in range(150):
        sizes = rng.integers(0, 30, int(rng.integers(0, 25)))
        max_tokens = int(rng.integers(1, 40))
        pieces, offsets = fixed_length_rows(sizes, max_tokens, drop_last)
        rows = [[tuple(p) for p in pieces[a:b].tolist()] for a, b in zip(offsets[:-1], offsets[1:])]
        assert rows == reference_rows(sizes.tolist(), max_tokens, drop_last)


def test_shuffled_rows_map_back_to_dataset_indices():
    lengths = np.array([5, 300, 7, 64, 1, 129])
    sampler = FixedLengthPackingSampler(lengths, max_tokens=64, seed=2)
    covered = np.zeros(lengths.sum(), dtype=int)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for row in sampler:
        assert sum(stop - start for _, start, stop in row) <= 64
        for index, start, stop in row:
            covered[starts[index] + start : starts[index] + stop] += 1
    assert (covered == 1).all()
    assert len(sampler) == -(-lengths.sum() // 64)


def test_rows_per_step_groups_consecutive_rows():
    # sizes [5, 3, 6], rows of 4 tokens: [(0,0,4)] [(0,4,5),(1,0,3)] [(2,0,4)] [(2,4,6)]; two rows per step.
    sampler = FixedLengthPackingSampler(np.array([5, 3, 6]), max_tokens=4, rows_per_step=2, shuffle=False)
    assert list(sampler) == [[(0, 0, 4), (0, 4, 5), (1, 0, 3)], [(2, 0, 4), (2, 4, 6)]]
    assert sampler.plan(0).max_tokens == 8
    three = FixedLengthPackingSampler(np.array([5, 3, 4]), max_tokens=4, rows_per_step=2, shuffle=False)
    assert len(three) == 2 and list(three)[-1] == [(2, 0, 4)]  # a last step of one row
    dropped = FixedLengthPackingSampler(
        np.array([5, 3, 4]), max_tokens=4, rows_per_step=2, shuffle=False, drop_last=True
    )
    assert list(dropped) == [[(0, 0, 4), (0, 4, 5), (1, 0, 3)]]
