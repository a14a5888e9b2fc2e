"""Numba kernels agree with their plain-Python originals (``kernel.py_func``) and with numpy."""

from __future__ import annotations

import numpy as np

from lit_packing.samplers import kernels


def test_counting_sort_is_a_stable_sort():
    rng = np.random.default_rng(0)
    for n_keys in (1, 2, 17, 4097):
        keys = rng.integers(0, n_keys, 500)
        perm, offsets = kernels.counting_sort(keys, n_keys)
        assert perm.tolist() == np.argsort(keys, kind="stable").tolist()
        assert offsets.tolist() == np.concatenate([[0], np.cumsum(np.bincount(keys, minlength=n_keys))]).tolist()
        py_perm, py_offsets = kernels.counting_sort.py_func(keys, n_keys)
        assert perm.tolist() == py_perm.tolist() and offsets.tolist() == py_offsets.tolist()


def test_next_fit_matches_python():
    rng = np.random.default_rng(1)
    for _ in range(100):
        capacity = int(rng.integers(1, 50))
        sizes = rng.integers(0, capacity + 1, int(rng.integers(0, 40)))
        offsets = kernels.next_fit(sizes, capacity)
        assert offsets.tolist() == kernels.next_fit.py_func(sizes, capacity).tolist()
        packs = np.split(sizes, offsets[1:-1])
        assert all(p.sum() <= capacity for p in packs)
        # Next-fit: the first item of each pack did not fit in the previous one.
        assert all(a.sum() + b[0] > capacity for a, b in zip(packs, packs[1:]))


def test_best_fit_decreasing_doc_example():
    bin_of, n_bins = kernels.best_fit_decreasing(np.array([6, 5, 4, 3, 2]), 10)
    assert bin_of.tolist() == [0, 1, 0, 1, 1] and n_bins == 2
