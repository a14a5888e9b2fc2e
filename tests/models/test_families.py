"""Every decoder family of the installed transformers packs exactly, or is refused in one line naming the model and
the module (or keyword) and the fix; the families table in docs/model.md is what this measures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.cli.test_day_two import main_py, one_line_error
from tests.models.families import decoder_families, measure, tiny_config

ROOT = Path(__file__).parents[2]
DOC = ROOT / "docs" / "model.md"
# Packed == per-example, fp32: the attention tests' tolerances (different kernels, same math; their loss tolerance,
# 1e-6 + 1e-6 relative, at a loss of ~ln(1000) = 6.9).
LOGITS, LOSS, GRADS = 2e-5, 8e-6, 1e-5


def assert_exact(row):
    assert not row.refused and not row.unbuilt, row
    assert row.logits <= LOGITS and row.loss <= LOSS and row.grads <= GRADS, row


def doc_table() -> dict[str, list[str]]:
    """The families table of docs/model.md: family -> its cells."""
    text = DOC.read_text()
    table = text.split("<!-- families table -->")[1]
    rows = {}
    for line in table.strip().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells
    return rows


def test_the_families_table_lists_every_decoder_family():
    assert sorted(doc_table()) == decoder_families(), "docs/model.md's families table lists other families"


@pytest.mark.parametrize("family", decoder_families())
def test_every_decoder_family_packs_exactly_or_is_refused_in_one_line(family):
    """The sweep behind the families table: the family's row in docs/model.md says what this measures."""
    row, cells = measure(family), doc_table()[family]
    if row.unbuilt:
        assert cells[2] == "not measured", (family, row.unbuilt)
    elif row.refused:
        line = row.refused
        assert "\n" not in line and len(line) < 700, line
        assert line.startswith("model.name_or_path: "), line
        assert re.search(r"(ForCausalLM|LMHeadModel|" + re.escape(family) + ")", line), line
        assert "configs/padding.yaml" in line, line
        assert cells[2] == "refused", (family, line)
    else:
        assert_exact(row)
        assert (cells[1], cells[2]) == (row.route, "exact"), (family, row.route)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bamba", "qwen3_next", "lfm2"])
def test_one_step_fit_through_the_cli(tmp_path, family):
    """Mamba 2, gated delta net and short-convolution hybrids train packed through the CLI, self-test passing."""
    config = {k: v for k, v in tiny_config(family).items() if k != "vocab_size"}
    done = main_py(
        tmp_path, "fit", "--config", "quickstart", f"--model.model_config={json.dumps(config)}",
        "--trainer.max_steps=1", "--data.limit=32", "--data.max_length=256",
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "isolation self-test passed" in output, output[-3000:]
    assert re.search(r"\d+ token mixers? besides attention: \d+ \w+ per example \(", output), output[-3000:]


def test_a_refused_family_through_the_cli_is_one_line(tmp_path):
    config = {k: v for k, v in tiny_config("doge").items() if k != "vocab_size"}
    last = one_line_error(
        main_py(
            tmp_path,
            "fit",
            "--config",
            "quickstart",
            f"--model.model_config={json.dumps(config)}",
            "--trainer.max_steps=1",
        )  # fmt: skip
    )
    assert "model.layers.0.self_attn (DogeAttention)" in last, last
