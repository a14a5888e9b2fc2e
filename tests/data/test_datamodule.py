"""PackingDataModule: deterministic splits, samplers built from lengths, Lightning sets their epoch, resumable state."""

from __future__ import annotations

import functools

import datasets
import numpy as np
import pytest
import torch
from jsonargparse import ArgumentParser
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch import LightningModule, Trainer

from lit_packing.batch import INDEX
from lit_packing.data import ChampChats, Chatterbot, HFDataset, PackingDataModule, PaddedCollator, split_rows
from lit_packing.data.tokenize import column
from lit_packing.samplers import BestFitPackingSampler, SequentialPackingSampler


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("datamodule"))


def ready(**kwargs) -> PackingDataModule:
    dm = PackingDataModule(**kwargs)
    dm.prepare_data()
    dm.setup("fit")
    return dm


@pytest.fixture(scope="module")
def chatterbot(cache_dir) -> PackingDataModule:
    return ready(source=Chatterbot(), limit=300, val_split=0.1, cache_dir=cache_dir)


def test_split_rows_is_deterministic_disjoint_and_complete():
    train, val = split_rows(100, 0.1, seed=7)
    assert len(val) == 10 and len(train) == 90
    np.testing.assert_array_equal(np.sort(np.concatenate([train, val])), np.arange(100))
    np.testing.assert_array_equal(split_rows(100, 0.1, seed=7)[1], val)
    assert not np.array_equal(split_rows(100, 0.1, seed=8)[1], val)
    assert len(split_rows(100, 25, seed=7)[1]) == 25
    assert len(split_rows(100, 0.0, seed=7)[1]) == 0
    assert len(split_rows(10, 0.01, seed=7)[1]) == 1  # a positive fraction keeps at least one
    with pytest.raises(ValueError, match="use an int for a count"):
        split_rows(100, 1.5, seed=7)
    with pytest.raises(ValueError, match="data.val_split: 100 examples leave no training data out of 100"):
        split_rows(100, 100, seed=7)


def test_setup_builds_split_datasets_and_report(chatterbot):
    dm = chatterbot
    assert (len(dm.train_lengths), len(dm.val_lengths)) == (270, 30)
    assert dm.train_lengths.dtype == np.int64 and dm.train_lengths.min() > 0
    assert dm.report.examples_in == 300 and dm.report.examples_out == 300
    assert dm.report.real_tokens == dm.train_lengths.sum() + dm.val_lengths.sum()
    assert (dm.vocab_size, dm.pad_token_id) == (49_152, 2)


def test_split_is_deterministic_and_by_source_row(chatterbot, cache_dir):
    again = ready(source=Chatterbot(), limit=300, val_split=0.1, cache_dir=cache_dir)
    val_rows = column(again.val_dataset.dataset, INDEX)
    np.testing.assert_array_equal(val_rows, column(chatterbot.val_dataset.dataset, INDEX))
    np.testing.assert_array_equal(val_rows, split_rows(300, 0.1, seed=42)[1])
    other = ready(source=Chatterbot(), limit=300, val_split=0.1, seed=1, cache_dir=cache_dir)
    assert not np.array_equal(column(other.val_dataset.dataset, INDEX), val_rows)


def test_train_dataloader_packs_with_the_seeded_sampler(chatterbot):
    loader = chatterbot.train_dataloader()
    sampler = chatterbot.train_sampler
    assert isinstance(sampler, BestFitPackingSampler) and sampler.seed == 42 and sampler.shuffle
    batches = list(loader)
    assert len(batches) == len(sampler)
    assert sum(b["counts"]["examples"] for b in batches) == 270
    assert sum(b["counts"]["real_tokens"] for b in batches) == chatterbot.train_lengths.sum()
    assert all(b["input_ids"].shape[1] <= 4096 for b in batches)


def test_val_dataloader_uses_the_train_factory_without_shuffle(chatterbot):
    loader = chatterbot.val_dataloader()
    assert loader.batch_sampler.sampler.shuffle is False
    assert sum(b["counts"]["examples"] for b in loader) == 30


def test_lightning_sets_the_sampler_epoch(chatterbot):
    loader = chatterbot.train_dataloader()
    _set_sampler_epoch(loader, 3)  # what Lightning's fit loop calls at each epoch start
    assert chatterbot.train_sampler.epoch == 3


def test_state_dict_resumes_mid_epoch(chatterbot, cache_dir):
    loader = chatterbot.train_dataloader()
    batches = iter(loader)
    next(batches), next(batches)
    state = chatterbot.state_dict()
    assert state["train_sampler"]["steps_done"] >= 2  # no trainer: the batches handed out
    rest = [b["input_ids"] for b in batches]
    resumed = ready(source=Chatterbot(), limit=300, val_split=0.1, cache_dir=cache_dir)
    resumed.load_state_dict(state)
    again = [b["input_ids"] for b in resumed.train_dataloader()]
    assert len(again) == len(rest) > 0
    assert all(torch.equal(a, b) for a, b in zip(again, rest))


def test_factories_and_collator_are_pluggable(cache_dir):
    dm = ready(
        source=Chatterbot(),
        limit=50,
        val_split=5,
        cache_dir=cache_dir,
        sampler=functools.partial(SequentialPackingSampler, max_tokens=512),
        val_sampler=functools.partial(BestFitPackingSampler, max_tokens=1024, shuffle=False),
        collator=PaddedCollator,
    )
    assert len(dm.val_lengths) == 5
    batch = next(iter(dm.train_dataloader()))
    assert "attention_mask" in batch and batch["input_ids"].shape[1] <= 512
    assert dm.train_sampler.seed == 42
    assert dm.val_dataloader().batch_sampler.sampler.max_tokens == 1024


def test_fixed_length_training_validates_whole_isolated_examples(cache_dir):
    from lit_packing.data import PackedCollator
    from lit_packing.samplers import FixedLengthPackingSampler

    dm = ready(
        source=Chatterbot(),
        limit=60,
        val_split=10,
        cache_dir=cache_dir,
        sampler=functools.partial(FixedLengthPackingSampler, max_tokens=64),
        collator=functools.partial(PackedCollator, isolate=False, row_length=64),
        val_sampler=functools.partial(BestFitPackingSampler, max_tokens=4096),
        val_collator=PackedCollator,
    )
    train = next(iter(dm.train_dataloader()))
    assert train["cu_seq_lens_q"].tolist() == [0, 64]  # one contaminated row
    val = [batch for batch in dm.val_dataloader()]
    assert sum(b["counts"]["examples"] for b in val) == 10
    assert sum(b["counts"]["real_tokens"] for b in val) == int(dm.val_lengths.sum())  # whole examples, not slices
    assert all(len(b["cu_seq_lens_q"]) == b["counts"]["examples"] + 1 for b in val)  # one segment per example


def test_no_validation_set(cache_dir):
    dm = ready(source=Chatterbot(), limit=20, val_split=0, cache_dir=cache_dir)
    assert dm.val_dataset is None and dm.val_dataloader() == [] and len(dm.val_lengths) == 0


def test_source_validation_split_is_used(tmp_path):
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    datasets.DatasetDict(
        train=datasets.Dataset.from_list([{"messages": chat}] * 6),
        validation=datasets.Dataset.from_list([{"messages": chat}] * 2),
    ).save_to_disk(str(tmp_path / "saved"))
    dm = ready(source=HFDataset(str(tmp_path / "saved")), val_split=0.5)
    assert (len(dm.train_lengths), len(dm.val_lengths)) == (6, 2)
    assert dm.report.examples_in == 8


def test_source_test_split_is_what_test_scores(tmp_path):
    def chats(answer, n):
        chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": answer}]
        return datasets.Dataset.from_list([{"messages": chat}] * n)

    datasets.DatasetDict(
        train=chats("Hello", 6), validation=chats("Hello there", 2), test=chats("Hello there, friend", 3)
    ).save_to_disk(str(tmp_path / "saved"))
    dm = ready(source=HFDataset(str(tmp_path / "saved")))
    assert (len(dm.train_lengths), len(dm.val_lengths), len(dm.test_dataset)) == (6, 2, 3)
    tested = [batch["counts"] for batch in dm.test_dataloader()]
    assert sum(c["examples"] for c in tested) == 3
    assert sum(c["real_tokens"] for c in tested) == int(dm.test_dataset.lengths.sum())
    assert dm.report.examples_in == 11


def test_without_a_test_split_test_scores_the_validation_examples_the_same_way(chatterbot):
    val, test = list(chatterbot.val_dataloader()), list(chatterbot.test_dataloader())
    assert [b["counts"] for b in val] == [b["counts"] for b in test]
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(val, test))


def test_split_errors_name_the_settings_to_change():
    with pytest.raises(ValueError, match=r"data\.val_split: 32 examples leave no training data out of 30.*0\.05"):
        split_rows(30, 32, seed=0)
    assert len(split_rows(30, 0.02, seed=0)[1]) == 1  # a fraction adapts: at least one held out
    assert len(split_rows(1_000_000, 0.02, seed=0)[1]) == 20_000


def test_yaml_config_instantiates(cache_dir):
    parser = ArgumentParser()
    parser.add_class_arguments(PackingDataModule, "data")
    config = parser.parse_object(
        {
            "data": {
                "source": {"class_path": "lit_packing.data.Chatterbot"},
                "limit": 40,
                "val_split": 4,
                "cache_dir": cache_dir,
                "sampler": {
                    "class_path": "lit_packing.samplers.BestFitPackingSampler",
                    "init_args": {"max_tokens": 256},
                },
                "collator": {"class_path": "lit_packing.data.PackedCollator", "init_args": {"pad_to_multiple_of": 64}},
            }
        }
    )
    dm = parser.instantiate(config).data
    assert isinstance(dm.source, Chatterbot) and dm.val_split == 4 and isinstance(dm.val_split, int)
    dm.prepare_data()
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert dm.train_sampler.max_tokens == 256 and dm.train_sampler.seed == 42
    assert batch["input_ids"].shape[1] % 64 == 0
    defaults = parser.instantiate(parser.parse_object({})).data
    assert isinstance(defaults.source, ChampChats)
    # jsonargparse expands the default class into a partial holding every default (seed=None: unset), so the data
    # module's seed fills it.
    sampler = defaults._build_sampler("sampler", defaults.sampler, np.array([3, 5]))
    assert isinstance(sampler, BestFitPackingSampler) and (sampler.seed, sampler.max_tokens) == (42, 4096)


def test_any_factory_gets_the_run_seed_unless_it_sets_one(chatterbot):
    """A sampler factory need not take `seed`: the run context reaches the sampler it returns, through `connect`,
    and fills the seed only where the factory left it unset."""

    def unseeded(lengths, shuffle=True):
        return SequentialPackingSampler(lengths, max_tokens=4096, shuffle=shuffle)

    def seeded(lengths, shuffle=True):
        return SequentialPackingSampler(lengths, max_tokens=4096, shuffle=shuffle, seed=0)

    assert chatterbot._build_sampler("sampler", unseeded, chatterbot.train_lengths).seed == chatterbot.seed == 42
    assert chatterbot._build_sampler("sampler", seeded, chatterbot.train_lengths).seed == 0


class EpochRecorder(LightningModule):
    """Trains nothing; records the sampler epoch Lightning set before each training batch."""

    def __init__(self, dm: PackingDataModule) -> None:
        super().__init__()
        self.dm = dm
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.epochs, self.val_batches = [], 0

    def training_step(self, batch, batch_idx):
        self.epochs.append(self.dm.train_sampler.epoch)
        return self.weight * batch["input_ids"].float().mean()

    def validation_step(self, batch, batch_idx):
        self.val_batches += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("val_split", [3, 0])
def test_fit_sets_the_epoch_and_validates(cache_dir, tmp_path, val_split):
    dm = PackingDataModule(source=Chatterbot(), limit=30, val_split=val_split, cache_dir=cache_dir)
    model = EpochRecorder(dm)
    trainer = Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm)
    steps = len(dm.train_sampler)
    assert model.epochs == [0] * steps + [1] * steps
    assert model.val_batches == (2 if val_split else 0)  # one validation pack per epoch
