"""A full disk during a fit's save, through the real CLI in-process: one line naming the folder and the room
needed, exit status 2, the previous checkpoint intact; and the CLI's defaults write every checkpoint atomically
and stop at a step's end on a preemption signal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lit_packing.callbacks.preemption import PreemptionCheckpoint
from lit_packing.checkpoint_io import AtomicCheckpointIO
from lit_packing.cli import cli_main
from tests.cli.test_resume import ROOT, chatterbot_run

# A disk that fills up after the first checkpoint: importable by class_path from the test's folder.
FULL_AFTER_ONE = """
import errno
from lit_packing.checkpoint_io import AtomicCheckpointIO

class FullAfterOne(AtomicCheckpointIO):
    saves = 0

    def open_partial(self, folder, partial):
        FullAfterOne.saves += 1
        if FullAfterOne.saves > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().open_partial(folder, partial)
"""


def run(tmp_path, model_config, *extra: str):
    callbacks = [{"class_path": "lit_packing.callbacks.LastCheckpoint", "init_args": {"every_n_train_steps": 1}}]
    return cli_main(
        ["fit", "--config", str(ROOT / "configs/quickstart.yaml"), *chatterbot_run(tmp_path, model_config, callbacks),
         "--trainer.max_steps=2", *extra]
    )  # fmt: skip


def test_a_full_disk_during_a_save_is_one_line_exit_2_and_the_previous_checkpoint_stays(
    tmp_path, tiny_llama_config, monkeypatch, capsys
):
    (tmp_path / "full_disk.py").write_text(FULL_AFTER_ONE)
    monkeypatch.syspath_prepend(str(tmp_path))
    plugin = json.dumps({"class_path": "full_disk.FullAfterOne"})
    with pytest.raises(SystemExit) as exited:
        run(tmp_path, tiny_llama_config, f"--trainer.plugins={plugin}")
    assert exited.value.code == 2
    errors = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]
    folder = tmp_path / "quickstart" / "version_0" / "checkpoints"
    assert len(errors) == 1 and errors[0].startswith(f"error: checkpoint last.ckpt not written: {folder} has "), errors
    assert "free and the checkpoint needs about" in errors[0] and "trainer.default_root_dir" in errors[0]
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 1  # the save before, intact
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]


def test_the_cli_writes_atomically_and_stops_on_preemption_by_default(tmp_path, tiny_llama_config):
    cli = run(tmp_path, tiny_llama_config)
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    assert isinstance(cli.trainer.callbacks[-1], PreemptionCheckpoint)  # after the ModelCheckpoints
    assert Path(cli.trainer.default_root_dir) == tmp_path / "quickstart" / "version_0"  # the run's own folder
    assert torch.load(tmp_path / "quickstart/version_0/checkpoints/last.ckpt", weights_only=True)["global_step"] == 2
