"""AtomicCheckpointIO: a save replaces the previous checkpoint whole or not at all, stages nothing in TMPDIR, and a
full disk is one line naming the folder and the room needed, with the previous checkpoint intact."""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lit_packing import checkpoint_io
from lit_packing.checkpoint_io import AtomicCheckpointIO, CheckpointSpaceError, tensor_bytes


class FailingFile(io.RawIOBase):
    """A file on a disk that fills up after `room` bytes (or is interrupted there: `error`)."""

    def __init__(self, file, room: int, error: BaseException):
        self.file, self.room, self.error = file, room, error

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self.room < len(data):
            raise self.error
        self.room -= len(data)
        return self.file.write(data)

    def fileno(self) -> int:
        return self.file.fileno()

    def close(self) -> None:
        self.file.close()
        super().close()


class FullDiskIO(AtomicCheckpointIO):
    def __init__(self, room: int, error: BaseException | None = None):
        self.room, self.error = room, error or OSError(errno.ENOSPC, "No space left on device")

    def open_partial(self, folder, partial):
        file, unnamed = super().open_partial(folder, partial)
        return FailingFile(file, self.room, self.error), unnamed


def checkpoint(seed: int) -> dict:
    torch.manual_seed(seed)
    weight = torch.randn(256, 256)
    return {"state_dict": {"weight": weight, "tied": weight}, "global_step": seed}


@pytest.fixture
def tmpdir_elsewhere(tmp_path, monkeypatch) -> Path:
    """TMPDIR pointed at a folder of its own, as on a node with a local /tmp."""
    staging = tmp_path / "TMPDIR"
    staging.mkdir()
    monkeypatch.setenv("TMPDIR", str(staging))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile reads TMPDIR again
    return staging


def test_a_save_replaces_the_checkpoint_in_its_folder_and_stages_nothing(tmp_path, tmpdir_elsewhere):
    path = tmp_path / "checkpoints" / "last.ckpt"
    for seed in (1, 2):
        AtomicCheckpointIO().save_checkpoint(checkpoint(seed), path)
        assert torch.load(path, weights_only=True)["global_step"] == seed
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]
    assert list(tmpdir_elsewhere.iterdir()) == []


def test_tensor_bytes_counts_a_tied_weight_once():
    assert tensor_bytes(checkpoint(1)) == 256 * 256 * 4


@pytest.mark.parametrize("room", [0, 100, 200_000])
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, tmpdir_elsewhere, room):
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(checkpoint(1), path)
    before = path.read_bytes()
    with pytest.raises(CheckpointSpaceError) as raised:
        FullDiskIO(room).save_checkpoint(checkpoint(2), path)
    message = str(raised.value)
    assert "\n" not in message
    assert f"checkpoint last.ckpt not written: {tmp_path} has " in message
    assert "needs about 262.1 kB" in message and "trainer.default_root_dir" in message
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["TMPDIR", "last.ckpt"]  # no partial file


def test_a_folder_without_room_is_named_before_anything_is_written(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(checkpoint(1), path)
    before = path.read_bytes()
    usage = checkpoint_io.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint_io.shutil, "disk_usage", lambda folder: usage._replace(free=1000))
    with pytest.raises(CheckpointSpaceError, match=r"has 1.0 kB free and the checkpoint needs about 262.1 kB"):
        FullDiskIO(room=0, error=AssertionError("no write may start")).save_checkpoint(checkpoint(2), path)
    assert path.read_bytes() == before


def test_a_save_interrupted_mid_write_leaves_the_previous_checkpoint_and_no_partial_file(tmp_path):
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(checkpoint(1), path)
    with pytest.raises((KeyboardInterrupt, RuntimeError)):  # torch's writer may answer it with its own error
        FullDiskIO(room=100_000, error=KeyboardInterrupt()).save_checkpoint(checkpoint(2), path)
    assert torch.load(path, weights_only=True)["global_step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_named_partial_file_a_killed_save_left_is_replaced_by_the_next_save(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    (tmp_path / ".last.ckpt.partial").write_bytes(b"PK\x03\x04 cut short")
    monkeypatch.delattr(checkpoint_io.os, "O_TMPFILE")  # a filesystem without unnamed files: the named way
    AtomicCheckpointIO().save_checkpoint(checkpoint(3), path)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    assert torch.load(path, weights_only=True)["global_step"] == 3


def test_trainer_save_checkpoint_goes_through_it_and_loads_back(tmp_path):
    trainer = Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=[AtomicCheckpointIO()],
    )  # fmt: skip
    model = BoringModel()
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "step2.ckpt")
    loaded = torch.load(tmp_path / "step2.ckpt", weights_only=True)
    assert loaded["global_step"] == 2
    torch.testing.assert_close(loaded["state_dict"]["layer.weight"], model.layer.weight)


# ----------------------------------------------------------------------------------------------------------------
# Distributed checkpoints (folders): ShardedStrategy


def folder_checkpoint(path: Path, step: int) -> None:
    path.mkdir()
    (path / "__0_0.distcp").write_text(f"shards of step {step}")
    (path / "meta.pt").write_text(f"loops at step {step}")


def test_a_folder_takes_the_name_of_the_previous_checkpoint_whole(tmp_path):
    last, partial = tmp_path / "last.ckpt", tmp_path / ".last.ckpt.partial"
    folder_checkpoint(last, 2)
    folder_checkpoint(partial, 4)
    checkpoint_io.replace_folder(partial, last)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert (last / "meta.pt").read_text() == "loops at step 4" and (last / "__0_0.distcp").read_text().endswith("4")


def test_leftovers_of_killed_saves_are_undone(tmp_path):
    # Killed between the renames: no last.ckpt, the previous one aside (put back); killed while writing: a partial
    # folder (removed); killed after the new one took its name: the previous one aside (removed).
    folder_checkpoint(tmp_path / ".last.ckpt.old", 2)
    folder_checkpoint(tmp_path / ".last.ckpt.partial", 4)
    folder_checkpoint(tmp_path / "step=6.ckpt", 6)
    folder_checkpoint(tmp_path / ".step=6.ckpt.old", 4)
    assert checkpoint_io.clear_leftovers(tmp_path) == [tmp_path / "last.ckpt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step=6.ckpt"]
    assert (tmp_path / "last.ckpt" / "meta.pt").read_text() == "loops at step 2"
    assert (tmp_path / "step=6.ckpt" / "meta.pt").read_text() == "loops at step 6"


# One process: a BoringModel sharded with FSDP2 on a 1-rank mesh saves `last.ckpt` (a folder) after 2 steps, then,
# its weights changed, saves it again and is killed once the shards are written, before `meta.pt` (SIGKILL).
KILLED_SAVE = """
import os, sys, torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from lit_packing.strategies import ShardedStrategy

class Sharded(BoringModel):
    def configure_model(self):
        fully_shard(self.layer, mesh=self.device_mesh["data_parallel"])

strategy = ShardedStrategy() if sys.argv[1] == "sharded" else ModelParallelStrategy()
trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
model = Sharded()
trainer.fit(model)
trainer.save_checkpoint(sys.argv[2])
torch.save(model.layer.weight.full_tensor().detach().clone(), sys.argv[3])
with torch.no_grad():
    model.layer.weight.add_(1.0)
torch.save(model.layer.weight.full_tensor().detach().clone(), sys.argv[4])
save = torch.save
def killed_at_meta(obj, f, *args, **kwargs):
    if str(f).endswith("meta.pt"):
        os.kill(os.getpid(), 9)
    return save(obj, f, *args, **kwargs)
torch.save = killed_at_meta
trainer.save_checkpoint(sys.argv[2])
"""


def read_folder(path: Path) -> tuple[torch.Tensor, int]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = path.parent.parent / "whole.pt"  # beside the checkpoints' folder
    dcp_to_torch_save(path, whole)
    weight = torch.load(whole, weights_only=True)["state_dict"]["layer.weight"]
    return weight, torch.load(path / "meta.pt", weights_only=True)["global_step"]


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.parametrize("strategy", ["sharded", "lightning"])
def test_a_distributed_checkpoint_save_killed_part_way_leaves_the_previous_one(tmp_path, strategy):
    script, last = tmp_path / "killed_save.py", tmp_path / "checkpoints" / "last.ckpt"
    script.write_text(KILLED_SAVE)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    saved, changed = tmp_path / "saved.pt", tmp_path / "changed.pt"  # the weights of the first save, of the second
    args = [sys.executable, str(script), strategy, str(last), str(saved), str(changed)]
    done = subprocess.run(args, env=env, capture_output=True, timeout=300)
    assert done.returncode == -9, done.stderr.decode()[-3000:]
    weight, step = read_folder(last)
    assert step == 2  # the first save's meta.pt
    if strategy == "lightning":  # the contrast: Lightning's writer rewrote the folder in place
        torch.testing.assert_close(weight, torch.load(changed), rtol=0, atol=0, msg="the new shards, old meta.pt")
        return
    torch.testing.assert_close(weight, torch.load(saved), rtol=0, atol=0)  # the previous checkpoint, whole
    assert sorted(p.name for p in last.parent.iterdir()) == [".last.ckpt.partial", "last.ckpt"]
    assert checkpoint_io.clear_leftovers(last.parent) == []
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]
