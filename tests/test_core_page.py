"""docs/core.md's two programs, run as they are: a plain PyTorch loop on the Lightning-free core trains, and a Hugging
Face `Trainer` fed by the best-fit sampler and the packed collator gives, step by step, the losses of the Lightning
path (`PackedCausalLM` on the same packs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from lit_packing.core import BestFitPackingSampler, PackedCollator, attach_step, model_inputs
from lit_packing.models import PackedCausalLM
from tests.models.families import tiny_config

PAGE = Path(__file__).parents[1] / "docs" / "core.md"


def programs() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)


def test_the_page_has_the_two_programs():
    assert len(programs()) == 2


def test_the_plain_pytorch_loop_trains(capsys):
    namespace: dict = {}
    exec(compile(programs()[0], str(PAGE), "exec"), namespace)
    losses = namespace["losses"]
    assert len(losses) >= 4 and losses[-1] < losses[0] - 0.1  # it learns (from ~10.8, ln of the vocabulary)
    assert f"{len(losses)} packed steps" in capsys.readouterr().out


class StepLosses(Callback):
    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def test_the_hugging_face_trainer_gives_the_lightning_paths_losses(tmp_path):
    namespace: dict = {}
    exec(compile(programs()[0] + programs()[1], str(PAGE), "exec"), namespace)
    hf_losses = namespace["trainer"].step_losses
    assert len(hf_losses) == 4

    torch.manual_seed(0)  # the Trainer's starting weights, as the page made them
    start = namespace["AutoModelForCausalLM"].from_config(namespace["config"])
    start.save_pretrained(tmp_path / "start")
    lm = PackedCausalLM(
        name_or_path=str(tmp_path / "start"), lr=1e-3, betas=(0.9, 0.95), scheduler="constant", memory_check=False
    )
    examples = namespace["examples"]
    sampler = BestFitPackingSampler(examples["length"], max_tokens=512, seed=0, shuffle=False)
    collate = PackedCollator()
    loader = DataLoader(examples, batch_sampler=sampler, collate_fn=lambda rows: attach_step([collate(rows)])[0])
    record = StepLosses()
    Trainer(
        accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[record], log_every_n_steps=1,
    ).fit(lm, loader)  # fmt: skip
    assert len(record.losses) == 4
    torch.testing.assert_close(torch.tensor(hf_losses), torch.tensor(record.losses), rtol=1e-5, atol=1e-5)


HYBRIDS = ("bamba", "qwen3_next", "lfm2")  # Mamba 2, gated delta net, short convolution beside attention layers


def with_model(program: str, family: str) -> str:
    """The page's program with a tiny `family` config in place of its Llama."""
    replaced = re.sub(
        r"config = AutoConfig\.for_model\(\n.*?\n\)",
        "config = AutoConfig.for_model(**HYBRID_CONFIG, vocab_size=len(tokenizer))",
        program,
        count=1,
        flags=re.S,
    )
    assert replaced != program, f"the page's config no longer reads as the test expects ({family})"
    return replaced


def assert_exact(model, examples) -> None:
    """The packed logits of the model a program trained equal each example run alone."""
    rows = [examples[i] for i in range(6)]
    model.eval()
    with torch.no_grad():
        ref = torch.cat([model(input_ids=torch.tensor([r["input_ids"]]), use_cache=False).logits[0] for r in rows])
        got = model(**model_inputs(PackedCollator()(rows)), use_cache=False).logits[0]
    diff = float((got - ref).abs().max())
    assert diff <= 1e-4 * max(1.0, float(ref.abs().max())), diff


@pytest.mark.parametrize("family", HYBRIDS)
def test_the_page_programs_are_exact_with_hybrid_models(family, capsys):
    """Both programs, a hybrid in place of the Llama: they train, and the trained model's packed logits equal
    each example run alone (its mixers went through `pack_model` with its attention)."""
    config = {k: v for k, v in tiny_config(family).items() if k != "vocab_size"}
    first, second = programs()
    namespace: dict = {"HYBRID_CONFIG": config}
    exec(compile(with_model(first, family), str(PAGE), "exec"), namespace)
    assert namespace["model"].config.model_type == family
    assert namespace["packing"].mixers and all(r.route == "per_example" for r in namespace["packing"].mixers)
    assert namespace["losses"][-1] < namespace["losses"][0]
    assert_exact(namespace["model"], namespace["examples"])
    exec(compile(second, str(PAGE), "exec"), namespace)
    assert len(namespace["trainer"].step_losses) == 4
    assert_exact(namespace["trainer"].model, namespace["examples"])
