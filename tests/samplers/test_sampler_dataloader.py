"""The samplers inside a torch DataLoader, and Lightning's per-epoch ``set_epoch`` call reaching them."""

from __future__ import annotations

import numpy as np
from lightning.fabric.utilities.data import _set_sampler_epoch
from torch.utils.data import DataLoader

from lit_packing._compat import batch_sampler_with_epoch
from lit_packing.samplers import BestFitPackingSampler, FixedLengthPackingSampler


class TokenDataset:
    """Example ``i`` is ``lengths[i]`` tokens; an ``(index, start, stop)`` key returns that slice."""

    def __init__(self, lengths):
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        self.examples = [list(range(s, s + n)) for s, n in zip(starts, lengths)]

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, key):
        if isinstance(key, tuple):
            index, start, stop = key
            return self.examples[index][start:stop]
        return self.examples[key]


def test_dataloader_yields_packs_and_empty_packs():
    lengths = np.array([6, 5, 3, 4, 2, 9])
    dataset = TokenDataset(lengths)
    seen = []
    for rank in range(2):
        sampler = BestFitPackingSampler(lengths, max_tokens=10, rank=rank, world_size=2)
        loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=lambda examples: examples)
        batches = list(loader)
        assert len(batches) == len(loader) == 2  # 3 packs over 2 ranks: rank 1's second pack is empty
        seen += [token for batch in batches for example in batch for token in example]
        assert all(sum(map(len, batch)) <= 10 for batch in batches)
    assert sorted(seen) == list(range(lengths.sum()))


def test_dataloader_with_token_slices():
    lengths = np.array([5, 300, 7, 64, 1, 129])
    sampler = FixedLengthPackingSampler(lengths, max_tokens=64)
    loader = DataLoader(
        TokenDataset(lengths), batch_sampler=sampler, collate_fn=lambda rows: [t for r in rows for t in r]
    )
    rows = list(loader)
    assert all(len(row) == 64 for row in rows[:-1])
    assert sorted(t for row in rows for t in row) == list(range(lengths.sum()))


def test_lightning_set_epoch_reaches_the_batch_sampler():
    """Lightning sets the epoch on `loader.batch_sampler.sampler`: the wrapper the data module uses puts ours there."""
    sampler = BestFitPackingSampler(np.arange(1, 50), max_tokens=64)
    batches = batch_sampler_with_epoch(sampler)
    loader = DataLoader(list(range(49)), batch_sampler=batches, collate_fn=list)  # dataset[i] = i
    _set_sampler_epoch(loader, 4)
    assert sampler.epoch == 4
    assert list(loader) == sampler.plan(4).packs() != sampler.plan(0).packs()
