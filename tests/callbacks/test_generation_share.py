"""`rollout/generation_share` (`TokenThroughputMonitor`): the seconds spent making on-policy rounds over those plus
the training seconds, in the throughput window, against fixed batches and a patched clock: the exact logged values."""

import pytest

from lit_packing.batch import ROUND
from lit_packing.data.collate import PackedCollator
from tests.callbacks.test_callbacks import BATCH_LENGTHS, examples, fit


def test_the_generation_share_is_the_rounds_seconds_over_rounds_and_training_in_the_window(tmp_path, monkeypatch):
    """Steps 0.5 s apart on the patched clock, window 2. The rank's round clock reads 0.3 s at step 0 (round 0, made
    before training started: counted, and not training time), 0.3 at step 1 (no round made), 0.4 at step 2 (0.1 s
    of a round made inside the step: out of its training time, 0.5 - 0.1)."""
    collate = PackedCollator(pad_to_multiple_of=16)
    batches = [collate(examples(lengths)) for lengths in BATCH_LENGTHS]
    for batch, made in zip(batches, (0.3, 0.3, 0.4)):
        batch[ROUND] = {"clock": {"sampling_s": made}}
    _, rows = fit(tmp_path, monkeypatch, batches)
    # (round s, train s) per step: (0.3, 0.5), (0.0, 0.5), (0.1, 0.4)
    expected = [0.3 / (0.3 + 0.5), (0.3 + 0.0) / (0.3 + 0.5 + 0.0 + 0.5), (0.0 + 0.1) / (0.0 + 0.5 + 0.1 + 0.4)]
    assert [row["rollout/generation_share"] for row in rows] == pytest.approx(expected)  # logged as float32
    # training time leaves the 0.1 s out: step 2's window trains 30 + 6 tokens in 0.5 + 0.4 s
    assert rows[2]["train/effective_tokens_per_sec"] == pytest.approx((30 + 6) / 0.9)


def test_data_without_rounds_logs_no_generation_share(tmp_path, monkeypatch):
    collate = PackedCollator(pad_to_multiple_of=16)
    _, rows = fit(tmp_path, monkeypatch, [collate(examples(lengths)) for lengths in BATCH_LENGTHS])
    assert rows and not any("rollout/generation_share" in row for row in rows)
