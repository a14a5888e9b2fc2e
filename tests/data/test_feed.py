"""A feed runs from its settings and its run-time inputs alone: built from a `FeedSettings` and handed a tokenizer
(no data module, no trainer), it publishes the contract and gives the training batches that `PackingDataModule`
gives for the same settings, cached and streamed."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from lit_packing.batch import INPUT_IDS, LABELS, POSITION_IDS
from lit_packing.data.cached import CachedFeed
from lit_packing.data.collate import PackedCollator
from lit_packing.data.datamodule import PackingDataModule
from lit_packing.data.feed import FeedSettings, pad_token_id
from lit_packing.data.packaged import Chatterbot
from lit_packing.data.stream_feed import StreamFeed
from lit_packing.samplers import BestFitPackingSampler, RunContext

MAX_TOKENS, SEED = 512, 3


def settings(cache_dir: str) -> FeedSettings:
    return FeedSettings(
        source=Chatterbot(), tokenizer_name="smollm2", max_length=128, overlong="truncate", train_on="completion",
        on_bad_row="error", val_split=8, limit=64, seed=SEED, num_workers=0, collator=PackedCollator,
        cache_dir=cache_dir, num_proc=None, buffer_size=32, declared_max_tokens=MAX_TOKENS,
    )  # fmt: skip


def build(lengths: np.ndarray, label_counter) -> BestFitPackingSampler:
    """The training sampler, connected as a run without a trainer connects it (the data seed, the label counter)."""
    return BestFitPackingSampler(lengths, max_tokens=MAX_TOKENS).connect(
        RunContext(seed=SEED, label_counter=label_counter)
    )


def batches(loader) -> list[tuple[list, list, list]]:
    return [tuple(b[key].tolist() for key in (INPUT_IDS, LABELS, POSITION_IDS)) for b in loader]


@pytest.mark.parametrize("streaming", [False, True], ids=["cached", "streamed"])
def test_a_feed_from_its_settings_gives_the_data_modules_contract_and_batches(tmp_path, smollm2_tokenizer, streaming):
    given = settings(str(tmp_path))
    feed = (StreamFeed if streaming else CachedFeed)(given)
    feed.prepare(smollm2_tokenizer)
    contract = feed.publish("fit", smollm2_tokenizer, None)
    mine = batches(feed.train_loader(build, smollm2_tokenizer, None))

    data = PackingDataModule(
        source=Chatterbot(), max_length=128, val_split=8, limit=64, seed=SEED, cache_dir=str(tmp_path),
        streaming=streaming, buffer_size=32, sampler=lambda lengths, **kw: BestFitPackingSampler(
            lengths, max_tokens=MAX_TOKENS, **kw),
    )  # fmt: skip
    assert dataclasses.replace(data.feed.settings, source=given.source) == given  # what the data module hands over
    data.prepare_data()
    data.setup("fit")
    assert len(mine) > 1 and mine == batches(data.train_dataloader())
    assert contract.token_id_range == data.contract.token_id_range
    assert contract.report.as_dict() == data.contract.report.as_dict()
    assert contract.largest_step() == data.largest_step() is not None
    assert len(feed.val_dataset) == len(data.val_dataset) > 0


def test_feed_settings_are_frozen_and_the_pad_id_falls_back_to_eos(tmp_path, smollm2_tokenizer, gpt2_tokenizer):
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings(str(tmp_path)).limit = 1  # type: ignore[misc]
    assert pad_token_id(smollm2_tokenizer) == smollm2_tokenizer.pad_token_id is not None
    tokenizer = copy.deepcopy(gpt2_tokenizer)
    tokenizer.pad_token = None
    assert pad_token_id(tokenizer) == tokenizer.eos_token_id is not None
    assert CachedFeed(settings(str(tmp_path))).collate(tokenizer).pad_token_id == tokenizer.eos_token_id
    tokenizer.eos_token = None
    assert pad_token_id(tokenizer) == 0
