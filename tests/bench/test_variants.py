"""The benchmark's tables and its home: variants run packaged configs, peer code loads only for peer rows, a row
whose package is missing is left out by default and a one-line error when chosen, `benchmarks/*.py` call the package."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from lit_packing.bench.run import BenchSettings, main
from lit_packing.bench.variants import INSTALL_BENCH, VARIANTS
from lit_packing.configs import DELTAS, composition
from lit_packing.errors import ConfigError

ROOT = Path(__file__).parents[2]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py"))


def test_our_variants_run_a_base_and_its_delta():
    for name, variant in VARIANTS.items():
        args = variant.config_args()
        assert args[::2] == ["--config"] * len(args[::2]), name
        assert [Path(a) for a in args[1::2]] == composition(variant.config), name
        assert variant.config in DELTAS, name  # every row is one of the paper's variants, on paper.yaml


def test_peer_code_loads_only_for_peer_rows():
    probe = (
        "import sys, lit_packing.cli, lit_packing.bench.run, lit_packing.bench.worker, lit_packing.bench.report\n"
        "print(sorted(m for m in sys.modules if m == 'trl' or m.startswith(('trl.', 'lit_packing.bench.peers'))))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_a_row_whose_package_is_missing(monkeypatch, tmp_path, capsys):
    """As without the `bench` extra: the TRL row is left out by default, and choosing it names the install."""
    monkeypatch.setitem(VARIANTS, "trl_bfd", replace(VARIANTS["trl_bfd"], needs="lit_packing_no_such_module"))
    assert not VARIANTS["trl_bfd"].installed and VARIANTS["hf_trainer"].installed
    assert BenchSettings().variants == [name for name in VARIANTS if name != "trl_bfd"]
    with pytest.raises(ConfigError, match="trl_bfd needs lit_packing_no_such_module"):
        BenchSettings(variants=["padding", "trl_bfd"])
    with pytest.raises(SystemExit) as exit_info:
        main(["--variants", "[trl_bfd]", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    out = capsys.readouterr().out.strip().splitlines()  # the error is the last line and the only one
    err = out[-1]
    assert [line for line in out if line.startswith("error:")] == [err]
    assert INSTALL_BENCH in err and 'pip install "lit_packing[bench]"' in err
    assert not list(tmp_path.iterdir())  # nothing ran


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_benchmark_scripts_call_the_package(script):
    spec = importlib.util.spec_from_file_location(f"benchmarks_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main is importlib.import_module(f"lit_packing.bench.{script.stem}").main


def test_the_smoke_run_has_its_own_folder():
    """`--smoke` never writes over the full benchmark's results (its table's label: tests/bench/test_bench.py)."""
    from pathlib import Path

    from lit_packing.bench.run import BenchSettings

    assert BenchSettings(smoke=True).out == Path("runs/bench_smoke") and BenchSettings().out == Path("runs/bench")
    assert BenchSettings(smoke=True, out=Path("elsewhere")).out == Path("elsewhere")  # a folder given is kept
