"""Non-finite losses and gradients stop the run (naming the step and its examples) or are skipped and counted;
`export` never writes non-finite weights; a run that trained nothing exits non-zero. Real CLI, tiny Llama."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lit_packing.cli import cli_main
from lit_packing.errors import TrainingError
from lit_packing.models import PackedCausalLM
from lit_packing.models.weights import FINITE_CHECK_ELEMENTS, all_finite

TINY = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 2048, "tie_word_embeddings": True,
}  # fmt: skip


def jsonl(path: Path, n: int = 40) -> str:
    rows = [
        {"messages": [{"role": "user", "content": f"What is {i}+{i}?"}, {"role": "assistant", "content": f"{2 * i}"}]}
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def fit_args(tmp_path: Path, data: str, *extra: str) -> list[str]:
    return [
        "fit",
        f"--model.model_config={json.dumps(TINY)}",
        "--data.source=lit_packing.data.HFDataset",
        f"--data.source.init_args.path={data}",
        "--data.source.init_args.split=train",
        "--data.val_split=0",
        f"--data.cache_dir={tmp_path / 'cache'}",
        "--data.sampler=lit_packing.samplers.BestFitPackingSampler",
        "--data.sampler.init_args.max_tokens=256",
        "--trainer.accelerator=cpu",
        "--trainer.max_steps=3",
        "--trainer.enable_checkpointing=false",
        "--trainer.logger=false",
        f"--trainer.default_root_dir={tmp_path}",
        *extra,
    ]


def test_nonfinite_gradient_stops_naming_the_step_and_its_rows(tmp_path, capsys):
    data, export = jsonl(tmp_path / "chats.jsonl"), tmp_path / "export"
    with pytest.raises(SystemExit) as exit_:
        cli_main(fit_args(tmp_path, data, "--model.lr=1e30", f"--model.export_dir={export}"))
    assert exit_.value.code == 2
    message = capsys.readouterr().out.strip().splitlines()[-1]
    # Step 1 moves every weight by ~1e30; the gradient of step 2 overflows.
    assert message.startswith("error: non-finite gradient at optimizer step 2 (epoch 0; examples of that step: line ")
    assert f"of {data}" in message and "model.nonfinite=skip" in message and "model.lr (now 1e+30)" in message
    assert not export.exists()


def test_nonfinite_steps_can_be_skipped_and_counted(tmp_path, capsys):
    data, export = jsonl(tmp_path / "chats.jsonl"), tmp_path / "export"
    cli = cli_main(
        fit_args(tmp_path, data, "--model.lr=1e30", "--model.nonfinite=skip", f"--model.export_dir={export}")
    )
    assert cli.trainer.global_step == 3 and cli.model.nonfinite_steps == 2  # steps 2 and 3 skipped
    assert float(cli.trainer.callback_metrics["train/nonfinite_steps"]) == 2.0
    assert "│ non-finite steps skipped │ 2" in capsys.readouterr().out
    weights = load_file(str(export / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())  # skipped steps changed nothing


def test_export_refuses_nonfinite_weights(tmp_path):
    lm = PackedCausalLM(model_config=TINY)
    with torch.no_grad():
        lm.hf_model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(
        TrainingError, match=r"not exporting to .*: 1 weight tensors hold NaN or inf \(first: .*down_proj"
    ):
        lm.export(str(tmp_path / "export"))
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_finiteness_check_sees_every_element_in_chunks(bad):
    """Checked a chunk at a time (its temporaries a chunk's, not the tensor's): a bad value is found wherever it
    is, in the last chunk, in a column of a transposed (non-contiguous) tensor, in a 0-dim tensor."""
    rows = 3 * FINITE_CHECK_ELEMENTS // 64 + 5  # more than three chunks of 64-wide rows, the last one short
    weight = torch.randn(rows, 64)
    assert all_finite(weight) and all_finite(weight.t()) and all_finite(torch.tensor(1.0))
    for where in ((rows - 1, 63), (0, 0), (rows // 2, 17)):
        broken = weight.clone()
        broken[where] = bad
        assert not all_finite(broken) and not all_finite(broken.t()), where
    assert not all_finite(torch.tensor(bad)) and not all_finite(torch.full((7,), bad, dtype=torch.bfloat16))


def test_everything_dropped_exits_2_before_training(tmp_path, capsys):
    data = jsonl(tmp_path / "chats.jsonl", n=5)
    with pytest.raises(SystemExit) as exit_:
        cli_main(fit_args(tmp_path, data, "--data.max_length=8", "--data.overlong=drop"))
    assert exit_.value.code == 2
    assert (
        capsys.readouterr()
        .out.strip()
        .splitlines()[-1]
        .startswith("error: nothing to train on: no example of 5 is left (tokenized 5 examples -> kept 0")
    )


def test_a_fit_that_took_no_step_exits_2(tmp_path, capsys):
    data = jsonl(tmp_path / "chats.jsonl")
    with pytest.raises(SystemExit) as exit_:
        cli_main(fit_args(tmp_path, data, "--trainer.max_time=00:00:00:00"))  # stops before the first step
    assert exit_.value.code == 2
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("error: fit took no optimizer step")
