"""The one seam between data and model: in a real fit, each side gets the other's contract once, the same object
every receiver sees, before either uses it."""

from __future__ import annotations

from lightning.pytorch import Callback, Trainer

from lit_packing.batch import StepShape
from lit_packing.contract import DataContract, ModelContract
from lit_packing.data import Chatterbot, PackingDataModule
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


def test_each_side_gets_the_others_contract_once_in_a_real_fit(tmp_path, smollm2_tokenizer):
    data = PackingDataModule(
        source=Chatterbot(), tokenizer="smollm2", limit=24, val_split=0, max_length=128,
        sampler=lambda lengths, **kw: BestFitPackingSampler(lengths, max_tokens=256, **kw),
        cache_dir=str(tmp_path / "cache"),
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
