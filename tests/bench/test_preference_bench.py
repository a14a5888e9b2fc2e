"""`python -m benchmarks.preference_throughput --smoke`: every row runs on the same pairs and the report's ratios are
the rows' own."""

from __future__ import annotations

import pytest

from benchmarks.preference_throughput import main


@pytest.mark.slow
def test_the_preference_benchmark_runs_every_row():
    report = main(["--smoke"])
    assert report["pairs"] == 8 and report["trl_steps"] == 4 and 1 <= report["packed_steps"] < report["trl_steps"]
    assert report["ratio"] == pytest.approx(report["packed_tokens_per_s"] / report["trl_tokens_per_s"])
    assert report["shared_ratio"] == pytest.approx(report["shared_tokens_per_s"] / report["trl_tokens_per_s"])
