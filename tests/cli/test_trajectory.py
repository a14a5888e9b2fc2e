"""The same training on any number of ranks, through the real CLI (DDP over gloo on CPU, fp32, a tiny Llama):

- one config with `data.packs_per_step=2` on 1 rank (2 accumulated) and on 2 ranks (1 each): the same packs in
  every optimizer step, the same per-step losses, the same final weights (within summation order);
- kill -9 on 2 ranks and `--ckpt_path` on 1 (and the reverse), with no global batch set: the resume keeps the
  checkpoint's global batch and ends with the uninterrupted run's weights and losses;
- the same with FSDP2 (`configs/fsdp2.yaml`): a distributed checkpoint written by 2 sharded ranks, killed, resumed
  on 1 (the model and AdamW state resharded from 2 shards to 1), the reverse, and 2 x 2 data x tensor parallel
  ranks resumed on 2 FSDP2 ranks, on the same trajectory;
- preference pairs (DPO, the reference log-probs precomputed) killed on 2 ranks and resumed on 1, likewise;
- a global batch the ranks cannot split is refused before anything starts.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from lit_packing.data import PackingDataModule
from lit_packing.errors import ConfigError
from tests.cli.test_resume import chatterbot_run, env
from tests.conftest import TINY_CONFIGS
from tests.helpers.launch import run, start

ROOT = Path(__file__).parents[2]
MAX_STEPS = 8
LLAMA = TINY_CONFIGS["llama"]

# Loaded by the runs from tmp_path: every micro-batch's source rows, and the loss of every optimizer step.
RECORDER = """
import json, time
from lightning.pytorch import Callback

class Recorder(Callback):
    def __init__(self, path: str, delay: float = 0.0):
        self.path, self.delay = path, delay

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        with open(f"{self.path}.rank{trainer.global_rank}", "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "rows": batch["rows"]}) + "\\n")
        time.sleep(self.delay)

    def on_train_start(self, trainer, pl_module):
        self.last = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.last and trainer.global_rank == 0:  # an optimizer step just ran
            self.last = trainer.global_step
            with open(f"{self.path}.loss", "a") as f:
                loss = float(trainer.callback_metrics["train/loss"])
                f.write(json.dumps({"step": trainer.global_step - 1, "loss": loss}) + "\\n")
"""


def fit_args(
    tmp_path: Path, model_config: dict, name: str, ranks: int, *extra: str, delay: float = 0.0, record: str = ""
) -> list[str]:
    """The run's arguments: checkpoints in `tmp_path/name`, records in `tmp_path/(record or name).*`."""
    callbacks = [
        {"class_path": "recorder.Recorder", "init_args": {"path": str(tmp_path / (record or name)), "delay": delay}},
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": str(tmp_path / name), "filename": "{step}", "every_n_train_steps": 2,
                          "save_top_k": -1},
        },
    ]  # fmt: skip
    return [
        sys.executable, str(ROOT / "main.py"), "fit", "--config", "quickstart",
        *chatterbot_run(tmp_path, model_config, callbacks),
        f"--trainer.devices={ranks}",
        f"--trainer.strategy={'ddp' if ranks > 1 else 'auto'}",
        f"--trainer.max_steps={MAX_STEPS}",
        "--trainer.log_every_n_steps=1",
        *extra,
    ]  # fmt: skip


def fit(tmp_path: Path, args: list[str]) -> str:
    done = run(args, cwd=tmp_path, env=env(tmp_path), timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


def kill_after(tmp_path: Path, args: list[str], checkpoint: Path) -> None:
    """Start the run, wait for `checkpoint` (a distributed checkpoint's folder: for its `meta.pt`, written last),
    let it train past it, then SIGKILL every process of the launch."""
    victim = start(args, cwd=tmp_path, env=env(tmp_path), new_session=True)
    deadline = time.monotonic() + 600
    while not written(checkpoint) and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.5)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    assert checkpoint.exists(), "the run ended before its checkpoint"


def written(checkpoint: Path) -> bool:
    return (checkpoint / "meta.pt").exists() if checkpoint.is_dir() else checkpoint.exists()


def losses(tmp_path: Path, *names: str) -> dict[int, float]:
    """The loss of every optimizer step, from the records of one launch or of several in turn (a later launch's
    record of a step wins: a resumed run redoes the steps lost after its checkpoint)."""
    found = {}
    for name in names:
        path = tmp_path / f"{name}.loss"
        found.update({r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())})
    return found


def steps(tmp_path: Path, *names: str) -> dict[int, list[int]]:
    """The sorted source rows each optimizer step trained, over all ranks, from one launch or several in turn (a
    later launch's micro-batches of a step replace an earlier one's)."""
    found: dict[int, list[int]] = {}
    for name in names:
        launch: dict[int, list[int]] = {}
        for path in sorted(tmp_path.glob(f"{name}.rank*")):
            for record in map(json.loads, path.read_text().splitlines()):
                launch.setdefault(record["step"], []).extend(record["rows"])
        found.update(launch)
    return {step: sorted(rows) for step, rows in found.items()}


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of |a - b| / |a| (Frobenius norms)."""
    return max(float((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-12)) for k in a)


def weights(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's model weights (its `state_dict`): of one file, or of a distributed checkpoint (FSDP2's
    folder, read whole into one process)."""
    if path.is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        whole = path.parent / f"{path.name}.whole.pt"
        dcp_to_torch_save(path, whole)
        path = whole
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run on 1 rank with 2 packs per optimizer step: (folder, losses, rows per step, weights)."""
    tmp = tmp_path_factory.mktemp("trajectory")
    (tmp / "recorder.py").write_text(RECORDER)
    out = fit(tmp, fit_args(tmp, LLAMA, "one", 1, "--data.packs_per_step=2"))
    assert "global batch: 2 packs per optimizer step (data.packs_per_step) = 1 rank x 2 accumulated" in out
    return tmp, losses(tmp, "one"), weights(tmp / "one" / f"step={MAX_STEPS}.ckpt")


def assert_same_trajectory(reference, name: str, *records: str) -> float:
    """The run's losses, packs per step and final weights (in `tmp/name`) against the uninterrupted 1-rank run's."""
    tmp, expected_losses, expected_weights = reference
    records = records or (name,)
    got = losses(tmp, *records)
    assert sorted(got) == sorted(expected_losses) == list(range(MAX_STEPS))
    for step, loss in expected_losses.items():
        assert got[step] == pytest.approx(loss, rel=1e-5), f"optimizer step {step}"
    assert steps(tmp, *records) == steps(tmp, "one")
    difference = relative_difference(expected_weights, weights(tmp / name / f"step={MAX_STEPS}.ckpt"))
    print(f"{name}: relative weight difference to the uninterrupted 1-rank run: {difference:.2e}")
    assert difference < 1e-4
    return difference


@pytest.mark.slow
def test_the_same_config_on_two_ranks_trains_the_same_steps(reference):
    tmp = reference[0]
    out = fit(tmp, fit_args(tmp, LLAMA, "two", 2, "--data.packs_per_step=2"))
    assert "global batch: 2 packs per optimizer step (data.packs_per_step) = 2 ranks x 1 accumulated" in out
    assert_same_trajectory(reference, "two")


@pytest.mark.slow
@pytest.mark.parametrize("before, after, accumulate", [(2, 1, 1), (1, 2, 2)], ids=["2 ranks -> 1", "1 rank -> 2"])
def test_kill_9_then_resume_on_another_world_size_keeps_the_trajectory(reference, before, after, accumulate):
    """No global batch set: the first launch's `ranks x accumulate_grad_batches` (2) is kept by the resume."""
    tmp = reference[0]
    name = f"killed_{before}_{after}"
    layout = [f"--trainer.accumulate_grad_batches={accumulate}"]
    kill_after(tmp, fit_args(tmp, LLAMA, name, before, *layout, delay=0.5), tmp / name / "step=4.ckpt")
    resume = [*layout, f"--ckpt_path={tmp / name / 'step=4.ckpt'}"]
    out = fit(tmp, fit_args(tmp, LLAMA, name, after, *resume, record=f"{name}_resumed"))
    now = f"{after} rank{'s' if after > 1 else ''} x {2 // after} accumulated"
    assert f"keeping the checkpoint's 2 packs per optimizer step ({before} rank" in out and now in out
    assert "the same 2 packs per optimizer step, the remaining steps as planned" in out
    kept = assert_same_trajectory(reference, name, name, f"{name}_resumed")
    if after == 1:  # the contrast: the same checkpoint resumed with a global batch of 1 pack is another trajectory
        changed = [f"--ckpt_path={tmp / name / 'step=4.ckpt'}", "--data.packs_per_step=1", "--trainer.max_steps=6"]
        out = fit(tmp, fit_args(tmp, LLAMA, f"{name}_changed", 1, *changed))
        assert "1 pack per optimizer step (data.packs_per_step) instead of the checkpoint's 2" in out
        assert "1 pack per optimizer step instead of 2, the " in out and "formed into new steps" in out
        at_6 = weights(tmp / name / "step=6.ckpt")  # the kept trajectory at step 6 (the resumed run saved it)
        difference = relative_difference(at_6, weights(tmp / f"{name}_changed" / "step=6.ckpt"))
        print(f"{name}: a changed global batch (1 pack) differs from the kept one by {difference:.2e}")
        assert difference > 100 * max(kept, 1e-7)


FSDP2 = ["--config", "fsdp2"]


def sharded_over(data: int, tensor: int = 1) -> list[str]:
    return [*FSDP2, f"--trainer.strategy.init_args.data_parallel_size={data}",
            f"--trainer.strategy.init_args.tensor_parallel_size={tensor}"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "before, after",
    [((2, 1), (1, 1)), ((1, 1), (2, 1)), ((2, 2), (2, 1))],
    ids=["2 shards -> 1", "1 shard -> 2", "2 x 2 tensor parallel -> 2 shards"],
)
def test_a_sharded_checkpoint_resumes_on_another_world_size_on_the_trajectory(reference, before, after):
    """FSDP2 (data x tensor parallel ranks) killed after its distributed checkpoint of step 4; `--ckpt_path` on
    another layout reads every weight and AdamW moment into the new shards (4 ranks' head and column splits into 2
    ranks' whole layers) and keeps the checkpoint's global batch of 2 packs."""
    tmp = reference[0]
    name = "sharded_{}x{}_{}x{}".format(*before, *after)
    runs = []
    for (data, tensor), extra in ((before, ()), (after, (f"--ckpt_path={tmp / name / 'step=4.ckpt'}",))):
        # The first launch's accumulation on both: the resume keeps its global batch (2 packs) by itself.
        layout = [*sharded_over(data, tensor), f"--trainer.accumulate_grad_batches={2 // before[0]}", *extra]
        runs.append(fit_args(tmp, LLAMA, name, data * tensor, *layout, delay=0.0 if extra else 0.5,
                             record=f"{name}_resumed" if extra else ""))  # fmt: skip
    kill_after(tmp, runs[0], tmp / name / "step=4.ckpt")
    tensor = before[1]
    for rank in range(before[0] * tensor):  # tensor-parallel peers (ranks r, r + 1) train the same batches
        if rank % tensor:
            peer = tmp / f"{name}.rank{rank}"
            assert peer.read_text() == (tmp / f"{name}.rank{rank - rank % tensor}").read_text()
            peer.unlink()  # counted once below, as its data-parallel rank
    out = fit(tmp, runs[1])
    if before[0] != after[0]:  # another number of data-parallel ranks: the global batch is kept, and says so
        assert f"keeping the checkpoint's 2 packs per optimizer step ({before[0]} rank" in out, out[-3000:]
        assert "the same 2 packs per optimizer step, the remaining steps as planned" in out
    assert_same_trajectory(reference, name, name, f"{name}_resumed")


# Preference pairs in place of chats: DPO on CHAMP pairs, the reference log-probs precomputed (the default).
PAIRS = ("--data.source=lit_packing.data.ChampPairs", "--data.collator=lit_packing.data.PairCollator",
         "--model.objective=dpo", "--model.lr=1e-4", "--data.limit=48", "--data.max_length=2048",
         "--data.overlong=drop", "--data.sampler.init_args.max_tokens=2048")  # fmt: skip


@pytest.fixture(scope="module")
def pair_reference(tmp_path_factory):
    """The uninterrupted DPO run on 1 rank with 2 packs of pairs per optimizer step (as `reference`)."""
    tmp = tmp_path_factory.mktemp("pair_trajectory")
    (tmp / "recorder.py").write_text(RECORDER)
    fit(tmp, fit_args(tmp, LLAMA, "one", 1, "--data.packs_per_step=2", *PAIRS))
    return tmp, losses(tmp, "one"), weights(tmp / "one" / f"step={MAX_STEPS}.ckpt")


@pytest.mark.slow
def test_pairs_killed_on_2_ranks_resume_on_1_on_the_trajectory(pair_reference):
    """Pairs are atoms of the plan as examples are: 2 ranks killed after step 4, resumed on 1 with the checkpoint's
    global batch; the resume takes the reference log-probs from the checkpoint (computed by the 2 ranks from the
    initial model) and trains the uninterrupted run's pairs, losses and weights."""
    tmp = pair_reference[0]
    name = "pairs_2_1"
    kill_after(tmp, fit_args(tmp, LLAMA, name, 2, *PAIRS, delay=0.5), tmp / name / "step=4.ckpt")
    out = fit(tmp, fit_args(tmp, LLAMA, name, 1, *PAIRS, f"--ckpt_path={tmp / name / 'step=4.ckpt'}",
                            record=f"{name}_resumed"))  # fmt: skip
    assert "keeping the checkpoint's 2 packs per optimizer step (2 ranks x 1 accumulated)" in out, out[-3000:]
    assert "from this run (a checkpoint" in out and "computing" not in out, out[-3000:]
    assert_same_trajectory(pair_reference, name, name, f"{name}_resumed")


def test_a_global_batch_the_ranks_cannot_split_is_refused(tmp_path):
    (tmp_path / "recorder.py").write_text(RECORDER)
    args = fit_args(tmp_path, LLAMA, "odd", 2, "--data.packs_per_step=3")
    done = run(args, cwd=tmp_path, env=env(tmp_path), timeout=300)
    assert done.returncode == 2
    assert done.stdout.strip().splitlines()[-1] == (
        "error: data.packs_per_step: 3 packs per optimizer step cannot be split evenly over 2 ranks "
        "(trainer.devices=2 x trainer.num_nodes=1); run on a number of ranks that divides 3 (1, 3), or set "
        "data.packs_per_step to a multiple of 2 (e.g. 2 or 4)"
    )


def test_a_resume_that_cannot_keep_the_global_batch_is_refused():
    """A checkpoint of 2 ranks x 1 resumed on 3 ranks (a real, not yet launched, DDP trainer)."""
    data = PackingDataModule()
    data.trainer = Trainer(accelerator="cpu", devices=3, strategy="ddp", logger=False)
    position = {"train_sampler": {"world_size": 2, "accumulate": 1}}
    with pytest.raises(ConfigError) as raised:
        data.load_state_dict(position)
    assert str(raised.value) == (
        "trainer.devices: the checkpoint's global batch of 2 packs per optimizer step (2 x 1 accumulated) cannot be "
        "split evenly over 3 ranks; run on a number of ranks that divides 2 (1, 2), or set data.packs_per_step to a "
        "multiple of 3 (e.g. 3 or 6) to change the global batch"
    )


@pytest.mark.parametrize(
    "saved, setting, configured, expected",
    [
        ((1, 2), 1, 1, 2),  # 2 x 1 resumed on 1 (kept as 1 x 2), resumed again there: still 1 x 2
        ((2, 1), 1, 1, 2),  # 2 x 1 resumed on 1 rank: 1 x 2
        ((1, 2), 1, 4, 4),  # the setting changed from 1 to 4: the user's new global batch
        ((1, 2), 2, 2, 2),  # nothing to change
    ],
)
def test_a_resume_keeps_the_global_batch_across_resumes(saved, setting, configured, expected):
    """The checkpoint records the configured `accumulate_grad_batches`, so a second resume still tells a derived
    accumulation from one the user changed (a real, not launched, one-process trainer)."""
    data = PackingDataModule()
    data.trainer = Trainer(accelerator="cpu", devices=1, accumulate_grad_batches=configured, logger=False)
    position = {"world_size": saved[0], "accumulate": saved[1]}
    data.load_state_dict({"train_sampler": position, "accumulate_setting": setting})
    assert data.trainer.accumulate_grad_batches == expected
