"""The install hints: an error for a missing optional package names `install_hint(extra)` (from a clone,
`pip install -e ".[extra]"`; from a wheel, `pip install "<wheel>[extra]"`), for an extra that pyproject.toml
declares; no source, page or config tells the user to install `lit_packing[...]` from an index that does not serve
it. That the wheel declares these extras: tests/test_install.py (slow)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from lit_packing.errors import ConfigError, install_hint
from lit_packing.models.head import check_liger
from lit_packing.models.quantize import adamw_8bit, quantization_settings
from lit_packing.models.rollouts import math_answer

ROOT = Path(__file__).parents[1]
EXTRAS = ("qlora", "liger", "stream", "rl", "bench", "vllm")  # the extras whose packages the errors name
INDEX_HINT = re.compile(r"pip install\s+\"?lit_packing\[")  # `pip install "lit_packing[qlora]"`: not on any index


def test_the_hint_names_the_clone_and_the_wheel():
    assert install_hint("rl") == (
        'pip install -e ".[rl]" at the root of your lit_packing clone, or pip install "<wheel>[rl]" with a wheel '
        "built from it"
    )


def test_every_extra_a_hint_names_is_declared():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = {m[1] for path in [*ROOT.glob("lit_packing/**/*.py"), *ROOT.glob("benchmarks/**/*.py")]
             for m in re.finditer(r"install_hint\([\"'](\w+)[\"']\)", path.read_text())}  # fmt: skip
    named.add(math_answer.requires[1])  # a reward function's extra, which `import_reward` hints at
    assert named == set(EXTRAS)
    assert named <= set(declared)


def test_no_page_or_source_says_to_install_from_an_index():
    files = [ROOT / "README.md", ROOT / "pyproject.toml", *ROOT.glob("docs/*.md"), *ROOT.glob("lit_packing/**/*"),
             *ROOT.glob("benchmarks/**/*.py")]  # fmt: skip
    found = []
    for path in files:
        text = path.read_text() if path.suffix in (".py", ".md", ".yaml", ".toml") else ""
        for hint in INDEX_HINT.finditer(text):
            line = text.count("\n", 0, hint.start()) + 1
            found.append(f"{path.relative_to(ROOT)}:{line}")
    assert not found


def test_missing_bitsandbytes_names_the_qlora_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed
    with pytest.raises(ConfigError) as error:
        quantization_settings("nf4", "bfloat16", True, {"r": 4}, None, deferred=False)
    assert str(error.value) == (
        f"model.quantization: nf4 needs bitsandbytes, which is not installed; {install_hint('qlora')}"
    )
    with pytest.raises(ConfigError) as error:
        adamw_8bit([{"params": [torch.nn.Parameter(torch.zeros(2))]}], lr=1e-3)
    assert str(error.value).endswith(f"; use adamw, or {install_hint('qlora')}")


def test_missing_liger_kernel_names_the_liger_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    with pytest.raises(ConfigError) as error:
        check_liger(torch.device("cuda"), torch.nn.Linear(2, 2))  # the device is only compared, never used
    assert str(error.value) == f"model.loss_impl: liger needs liger-kernel; {install_hint('liger')}"
