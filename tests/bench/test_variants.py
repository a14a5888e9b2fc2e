"""The benchmark's tables and its home: variants run packaged configs, peer code loads only for peer rows, a row
whose package is missing is left out by default and a one-line error when chosen; the benchmark lives once, in
`benchmarks/` (not in the package), each script a module of it, and its imports form no cycle."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.run import BenchSettings, main
from benchmarks.variants import INSTALL_BENCH, VARIANTS
from lit_packing.configs import DELTAS, composition
from lit_packing.errors import ConfigError
from tests.test_layers import import_cycles

ROOT = Path(__file__).parents[2]
MODULES = {f"benchmarks.{p.stem}": p for p in sorted((ROOT / "benchmarks").glob("*.py")) if p.stem != "__init__"}
SCRIPTS = [name for name, path in MODULES.items() if 'if __name__ == "__main__"' in path.read_text()]


def test_our_variants_run_a_base_and_its_delta():
    for name, variant in VARIANTS.items():
        args = variant.config_args()
        assert args[::2] == ["--config"] * len(args[::2]), name
        assert [Path(a) for a in args[1::2]] == composition(variant.config), name
        assert variant.config in DELTAS, name  # every row is one of the paper's variants, on paper.yaml


def test_peer_code_loads_only_for_peer_rows():
    probe = (
        "import sys, lit_packing.cli, benchmarks.run, benchmarks.worker, benchmarks.report\n"
        "print(sorted(m for m in sys.modules if m == 'trl' or m.startswith(('trl.', 'benchmarks.peers'))))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
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
    assert INSTALL_BENCH in err
    assert err.endswith(
        '; pip install -e ".[bench]" at the root of your lit_packing clone, or pip install '
        '"<wheel>[bench]" with a wheel built from it, or leave trl_bfd out'
    )
    assert not list(tmp_path.iterdir())  # nothing ran


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_is_a_module_of_the_benchmarks_package(script):
    """`python -m benchmarks.<name>` (and `python -m benchmarks`) from the repository root: each has its `main`."""
    assert callable(importlib.import_module(script).main)


def test_the_benchmark_is_not_in_the_package():
    assert not (ROOT / "lit_packing" / "bench").exists()
    importers = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "lit_packing").rglob("*.py"))
        if "benchmarks" in imported(path)
    ]
    assert not importers, f"the installed package must not import the benchmark: {importers}"


def imported(path: Path) -> set[str]:
    """Every module name an `import` or `from ... import` of the file names (function bodies included), and for a
    `from package import name` also `package.name`."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found | {name.split(".")[0] for name in found}


def test_the_benchmark_imports_have_no_cycle():
    """Not even through a function body's import (`worker` imports `peers` for a peer's row): what two benchmark
    modules share is in `benchmarks.common`."""
    graph = {name: sorted((imported(path) & set(MODULES)) - {name}) for name, path in MODULES.items()}
    cycles = import_cycles(graph)
    assert not cycles, "\n".join(cycles)
    assert graph["benchmarks.common"] == ["benchmarks.variants"]  # the shared helpers import no other benchmark


def test_the_smoke_run_has_its_own_folder():
    """`--smoke` never writes over the full benchmark's results (its table's label: tests/bench/test_bench.py)."""
    from pathlib import Path

    from benchmarks.run import BenchSettings

    assert BenchSettings(smoke=True).out == Path("runs/bench_smoke") and BenchSettings().out == Path("runs/bench")
    assert BenchSettings(smoke=True, out=Path("elsewhere")).out == Path("elsewhere")  # a folder given is kept
