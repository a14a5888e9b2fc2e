"""A stream through the real CLI (`data.streaming`, 2 tokenizing workers, windows of 48 chats, a tiny Llama, fp32):
the same optimizer steps and weights on 1 rank and 2 (gloo DDP), and kill -9 mid-window then `--ckpt_path` on the
same number of ranks, on fewer and on more: the uninterrupted run's packs in every step, its losses, its weights."""

from __future__ import annotations

import pytest

from tests.cli.test_trajectory import (
    LLAMA,
    MAX_STEPS,
    RECORDER,
    fit,
    fit_args,
    kill_after,
    losses,
    relative_difference,
    steps,
    weights,
)

STREAM = [
    "--data.streaming=true",
    "--data.buffer_size=48",
    "--data.limit=null",
    "--data.val_split=0",
    "--data.num_workers=2",
    "--trainer.val_check_interval=1.0",
]


def stream_args(tmp, name: str, ranks: int, *extra: str, **kwargs) -> list[str]:
    return fit_args(tmp, LLAMA, name, ranks, *STREAM, *extra, **kwargs)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted stream on 1 rank, 2 packs per optimizer step: (folder, losses, final weights)."""
    tmp = tmp_path_factory.mktemp("stream")
    (tmp / "recorder.py").write_text(RECORDER)
    out = fit(tmp, stream_args(tmp, "one", 1, "--data.packs_per_step=2"))
    assert "streamed in windows of 48 examples" in out
    assert "window fill (mean)" in out and "share of real tokens: chatterbot" in out  # the summary's stream rows
    return tmp, losses(tmp, "one"), weights(tmp / "one" / f"step={MAX_STEPS}.ckpt")


def assert_same_run(reference, name: str, *records: str) -> None:
    tmp, expected_losses, expected_weights = reference
    got = losses(tmp, *(records or (name,)))
    assert sorted(got) == list(range(MAX_STEPS))
    for step, loss in expected_losses.items():
        assert got[step] == pytest.approx(loss, rel=1e-5), f"optimizer step {step}"
    assert steps(tmp, *(records or (name,))) == steps(tmp, "one")
    difference = relative_difference(expected_weights, weights(tmp / name / f"step={MAX_STEPS}.ckpt"))
    print(f"{name}: relative weight difference to the uninterrupted 1-rank stream: {difference:.2e}")
    assert difference < 1e-4


@pytest.mark.slow
def test_a_stream_on_two_ranks_trains_the_same_steps(reference):
    tmp = reference[0]
    fit(tmp, stream_args(tmp, "two", 2, "--data.packs_per_step=2"))
    assert_same_run(reference, "two")


@pytest.mark.slow
@pytest.mark.parametrize("before, after", [(1, 1), (2, 1), (1, 2)], ids=["1 -> 1", "2 ranks -> 1", "1 rank -> 2"])
def test_kill_9_mid_window_then_resume(reference, before, after):
    tmp = reference[0]
    name = f"killed_{before}_{after}"
    checkpoint = tmp / name / "step=4.ckpt"
    kill_after(tmp, stream_args(tmp, name, before, "--data.packs_per_step=2", delay=0.5), checkpoint)
    resume = ["--data.packs_per_step=2", f"--ckpt_path={checkpoint}"]
    out = fit(tmp, stream_args(tmp, name, after, *resume, record=f"{name}_resumed"))
    assert "resumed at optimizer step 4: epoch 0, window" in out
    assert_same_run(reference, name, name, f"{name}_resumed")
