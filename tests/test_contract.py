"""The seams between data and model in real fits: each side gets the other's contract once, the same object every
receiver sees, before either uses it (cached and streamed); and a resume onto another layout, where the data's feed
makes Lightning count the micro-batches the data counts as trained."""

from __future__ import annotations

import functools

import pytest
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_packing.batch import StepShape
from lit_packing.contract import DataContract, DataModelConnection, ModelContract
from lit_packing.data import Chatterbot, PackingDataModule
from lit_packing.data.feed import Feed
from lit_packing.models import PackedCausalLM
from lit_packing.samplers import BestFitPackingSampler
from tests.conftest import TINY


class Receiver(Callback):
    """A callback that asks for the data's contract, as the monitors do."""

    def __init__(self):
        self.received: list[DataContract] = []
        self.model_had_it_at_setup = False

    def connect_data(self, data: DataContract) -> None:
        self.received.append(data)

    def on_fit_start(self, trainer, pl_module):
        self.model_had_it_at_setup = pl_module._data is not None


@pytest.mark.parametrize("streaming", [False, True], ids=["cached", "streamed"])
def test_each_side_gets_the_others_contract_once_in_a_real_fit(tmp_path, smollm2_tokenizer, streaming):
    data = PackingDataModule(
        source=Chatterbot(), tokenizer="smollm2", limit=24, val_split=0, max_length=128,
        sampler=lambda lengths, **kw: BestFitPackingSampler(lengths, max_tokens=256, **kw),
        cache_dir=str(tmp_path / "cache"), streaming=streaming,
    )  # fmt: skip
    model = PackedCausalLM(model_config=dict(TINY), memory_check=False)
    receiver = Receiver()
    Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[receiver], limit_val_batches=0,
    ).fit(model, datamodule=data)  # fmt: skip

    assert receiver.received == [data.contract] and receiver.received[0] is model._data  # once, one object
    assert receiver.model_had_it_at_setup
    assert isinstance(data.model_contract, ModelContract)
    assert data.model_contract.shape == model.contract.shape  # the model's shape, as its contract states it
    contract = data.contract
    low, high = contract.token_id_range
    assert contract.tokenizer is data.tokenizer and 0 <= low <= high < len(smollm2_tokenizer)
    step = contract.largest_step()
    assert isinstance(step, StepShape) and 0 < step.slot_tokens <= 256 and not step.padded
    assert contract.name_rows([0]).startswith(("row", "line", "example"))
    assert contract.sources == ((("chatterbot", 1.0),) if streaming else ())


def quiet(**kwargs) -> Trainer:
    return Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, **kwargs,
    )  # fmt: skip


class Steps(Callback):
    """`(batch_idx, global_step)` at every training batch end, and the feeds attached to the trainer then."""

    def __init__(self):
        self.ends: list[tuple[int, int]] = []
        self.feeds: list[list[Feed]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ends.append((batch_idx, trainer.global_step))
        self.feeds.append([c for c in trainer.callbacks if isinstance(c, Feed)])


def test_a_resume_onto_another_global_batch_continues_at_the_datas_trained_micro_batch(tmp_path, smollm2_tokenizer):
    """3 optimizer steps of 1 pack, resumed with 2 packs per step (31 packs an epoch): the data counts 3 steps of the
    new layout, 6 micro-batches, as trained, and the feed moves Lightning's count there at train start, so that the
    next batch is index 6 and the optimizer steps after every 2 packs from it (without the feed: after batch 3, on
    one pack)."""

    def data(**kwargs) -> PackingDataModule:
        return PackingDataModule(
            source=Chatterbot(), limit=60, val_split=0, max_length=128, cache_dir=str(tmp_path / "cache"),
            sampler=functools.partial(BestFitPackingSampler, max_tokens=128), **kwargs,
        )  # fmt: skip

    def model() -> PackedCausalLM:
        return PackedCausalLM(model_config=dict(TINY), memory_check=False)

    save = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=3, save_top_k=-1)
    quiet(max_steps=3, callbacks=[save]).fit(model(), datamodule=data())
    resumed, steps = data(packs_per_step=2), Steps()
    trainer = quiet(max_steps=5, callbacks=[steps], enable_checkpointing=False)
    trainer.fit(model(), datamodule=resumed, ckpt_path=tmp_path / "ckpt" / "step=3.ckpt")

    assert trainer.accumulate_grad_batches == 2 and resumed.resumed_at == 6
    assert steps.ends == [(6, 3), (7, 4), (8, 4), (9, 5)]
    assert steps.feeds == [[resumed.feed]] * 4  # attached once for the fit, by its data module
    assert resumed.feed not in trainer.callbacks  # and detached at its end
    assert "on_train_start" not in vars(DataModelConnection)  # the feed aligns, the connection only connects
