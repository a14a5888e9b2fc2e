"""End to end on the real SmolLM2: padded and mini-batch-packed fits of the same steps give the same losses.

Short chatterbot dialogues (13-556 tokens) keep real padding in every padded step at CPU-test cost; the CHAMP run of
the same benchmark is in docs/loss_parity.txt.
"""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "loss_parity.py"


@pytest.mark.slow
def test_packed_fit_matches_padded_fit_step_by_step(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("loss_parity", SCRIPT)
    parity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parity)
    results = parity.main(
        ["--steps", "3", "--batch_size", "4", "--max_length", "384", "--limit", "48", "--val_examples", "8",
         "--val_batches", "2", "--out", str(tmp_path), "--data.source=lit_packing.data.Chatterbot"]
    )  # fmt: skip
    padded, packed = results["padding"], results["mini-batch packing"]
    assert len(padded["train/loss"]) == len(packed["train/loss"]) == 3
    assert packed["train/loss"] == pytest.approx(padded["train/loss"], rel=2e-4)
    assert packed["val/loss"][-1] == pytest.approx(padded["val/loss"][-1], rel=2e-4)
    assert max(padded["train/padding_ratio"]) > 0 and max(packed["train/padding_ratio"]) == 0
    assert (tmp_path / "loss_parity.png").exists()
