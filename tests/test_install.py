"""`pip install .` into a fresh virtual environment outside the repository runs the documented commands.

The wheel is built from a copy of the package's sources, installed with `--no-deps` into a new venv that sees the
development venv's packages (a `.pth` file pointing at a folder of links to them) except lit_packing itself and TRL,
i.e. a plain install without the `bench` extra. From a folder outside the repository, with the Hub offline:
`lit-packing fit --config quickstart` (tiny random model, 2 steps), `lit-packing report --config quickstart` and
`lit-packing configs`. The benchmark is not in the wheel: `lit-packing bench` answers, in one line, that it runs from a
checkout with `python -m benchmarks`. The wheel itself ships every file the package reads at run time and declares
the extras the install hints name (`errors.install_hint`), and the hint for a wheel, `pip install "<wheel>[extra]"`,
resolves (a dry run, offline, for each extra whose packages the development venv holds).
"""

from __future__ import annotations

import email.message
import email.parser
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from lit_packing.errors import install_hint
from tests.conftest import TINY
from tests.test_install_hints import EXTRAS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[1]
DEV_SITE = Path(sysconfig.get_paths()["purelib"])
SMALL_RUN = [f"--model.model_config={json.dumps(TINY)}", "--data.limit=64", "--data.val_split=8",
             "--data.max_length=256"]  # fmt: skip
# In the package but not in the wheel: a launcher script that `sbatch` runs from a checkout, which no module reads.
NOT_SHIPPED = {"lit_packing/configs/multinode.sbatch"}


def hidden(name: str) -> bool:
    """Entries of the development site-packages the fresh venv must not see: lit_packing's editable install (its
    `.pth` hook and finder, its metadata) and TRL (the `bench` extra); `.pth` files are not run from there anyway."""
    return name.startswith(("lit_packing", "__editable__", "trl-")) or name == "trl" or name.endswith(".pth")


def run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout, check=False)


def ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, f"{' '.join(done.args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the checkout's package (the build writes build/ and *.egg-info next to the
    sources), as `pip wheel` or `python -m build` builds it from a clone."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "lit_packing", source / "lit_packing", ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)]
    ok(run([*build, str(source)], dict(os.environ), tmp))
    (built,) = wheels.glob("lit_packing-*.whl")
    return built


def wheel_metadata(wheel: Path) -> email.message.Message:
    """The wheel's METADATA (its `Provides-Extra` and `Requires-Dist` lines)."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(archive.read(name).decode())


def by_extra(requirements: list[str], extra: str) -> set[tuple[str, str]]:
    """The (name, specifier) pairs of a wheel's `Requires-Dist` lines that `extra` adds (their `extra == ...`)."""
    parsed = map(Requirement, requirements)
    return {
        (canonicalize_name(r.name), str(r.specifier))
        for r in parsed
        if r.marker and r.marker.evaluate({"extra": extra})
    }


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> dict:
    """The wheel installed in a fresh venv; its bin folder, a working folder and the commands' env."""
    tmp = tmp_path_factory.mktemp("install")
    env_dir = tmp / "venv"
    ok(run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], dict(os.environ), tmp))
    python = env_dir / "bin" / "python"
    site = Path(ok(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       dict(os.environ), tmp)).stdout.strip())  # fmt: skip
    deps = tmp / "deps"
    deps.mkdir()
    for entry in DEV_SITE.iterdir():
        if not hidden(entry.name):
            (deps / entry.name).symlink_to(entry)
    (site / "dev_packages.pth").write_text(f"{deps}\n")
    ok(run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
            str(wheel)], dict(os.environ), tmp))  # fmt: skip

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PATH=f"{env_dir / 'bin'}{os.pathsep}{env['PATH']}", VIRTUAL_ENV=str(env_dir), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")  # fmt: skip
    work = tmp / "work"  # outside the repository: nothing of the checkout is importable or readable from here
    work.mkdir()
    return {"bin": env_dir / "bin", "site": site, "env": env, "work": work}


def test_the_wheel_ships_what_the_package_reads(wheel):
    """Every file of the package that is not Python (the configs, ArithmeticRollouts' groups) is in the wheel; the
    benchmark and the checkout's own files are not; the `lit-packing` command is declared."""
    shipped = set(zipfile.ZipFile(wheel).namelist())
    package = ROOT / "lit_packing"
    data = {path.relative_to(ROOT).as_posix() for path in package.rglob("*")
            if path.is_file() and path.suffix != ".py" and "__pycache__" not in path.parts}  # fmt: skip
    assert {"lit_packing/configs/quickstart.yaml", "lit_packing/data/rollouts/arithmetic.jsonl"} <= data
    assert sorted(data - NOT_SHIPPED - shipped) == []
    outside = ("tests/", "benchmarks/", "configs/", "main.py", "lit_packing/bench/")  # the benchmark: a checkout's
    assert not [name for name in shipped if name.startswith(outside)]
    (entry_points,) = [name for name in shipped if name.endswith(".dist-info/entry_points.txt")]
    assert "lit-packing = lit_packing.commands:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_wheel_declares_every_extra_the_hints_name(wheel):
    """`Provides-Extra` for each extra an install hint names, each adding the requirements pyproject.toml lists."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    metadata = wheel_metadata(wheel)
    assert set(EXTRAS) <= set(metadata.get_all("Provides-Extra"))
    requires = metadata.get_all("Requires-Dist")
    for extra in EXTRAS:
        listed = {(canonicalize_name(r.name), str(r.specifier)) for r in map(Requirement, declared[extra])}
        assert by_extra(requires, extra) == listed, extra


def test_the_hint_for_a_wheel_resolves(wheel):
    """The hint's wheel command, `pip install "<wheel>[extra]"` with the built wheel, as a dry run resolved offline
    against the development venv (`--no-index`): lit_packing with the extra is all it would install, every
    requirement the extra adds already satisfied. Run for the extras the `dev` extra installs with their own
    requirements (bench, qlora, rl); `stream`'s litdata is installed without torchvision (the Makefile) and `liger`
    needs CUDA, so those two are checked by their metadata only (above)."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")
    dev = map(
        Requirement, tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    )
    (itself,) = [requirement for requirement in dev if canonicalize_name(requirement.name) == "lit-packing"]
    here = sorted(itself.extras)
    assert "qlora" in here and set(here) <= set(EXTRAS)
    for extra in here:
        (command,) = re.findall(r'pip install "<wheel>\[\w+\]"', install_hint(extra))
        argv = shlex.split(command.replace("<wheel>", str(wheel)))
        done = ok(run([sys.executable, "-m", *argv, "--dry-run", "--no-index", "-q", "--report", "-"],
                      dict(os.environ), wheel.parent))  # fmt: skip
        assert "does not provide the extra" not in done.stderr, done.stderr
        report = json.loads(done.stdout)
        assert [(i["metadata"]["name"], i["requested_extras"]) for i in report["install"]] == [("lit_packing", [extra])]


def test_the_wheel_is_what_imports(venv):
    probe = (
        "import importlib.util, lit_packing, lit_packing.configs as c\n"
        "print(lit_packing.__file__); print(c.config_path('quickstart')); print(importlib.util.find_spec('trl'))"
    )
    lines = ok(run([str(venv["bin"] / "python"), "-c", probe], venv["env"], venv["work"])).stdout.splitlines()
    assert lines[0].startswith(str(venv["site"] / "lit_packing")), lines[0]
    assert lines[1] == str(venv["site"] / "lit_packing" / "configs" / "quickstart.yaml")
    assert lines[2] == "None"  # no bench extra here


def test_fit_by_config_name(venv):
    out = venv["work"] / "fit"
    logger = {"class_path": "CSVLogger", "init_args": {"save_dir": str(out), "name": "quickstart"}}
    fit = [str(venv["bin"] / "lit-packing"), "fit", "--config", "quickstart", *SMALL_RUN, "--trainer.max_steps=2",
           f"--trainer.logger={json.dumps(logger)}", f"--trainer.default_root_dir={out}",
           "--trainer.enable_checkpointing=false"]  # fmt: skip
    done = ok(run(fit, venv["env"], venv["work"]))
    assert "effective tokens/s" in done.stdout  # the end-of-fit summary
    (metrics,) = out.glob("quickstart/version_*/metrics.csv")
    header, *rows = metrics.read_text().splitlines()
    assert "train/loss" in header and "val/loss" in header and rows
    assert (metrics.parent / "config.yaml").is_file()


def test_packing_report_by_config_name(venv):
    png = venv["work"] / "report" / "packing_report.png"
    png.parent.mkdir()
    report = [str(venv["bin"] / "lit-packing"), "report", "--config", "quickstart", *SMALL_RUN, "--out", str(png)]
    done = ok(run(report, venv["env"], venv["work"]))
    assert re.search(r"quickstart: \d+ examples, batch_size=8, max_tokens=2,048", done.stdout)  # the table's title
    assert "straggler factor" in done.stdout
    assert png.stat().st_size > 10_000


def test_the_packaged_configs_are_listed(venv):
    done = ok(run([str(venv["bin"] / "lit-packing"), "configs"], venv["env"], venv["work"]))
    names = [line.split()[0] for line in done.stdout.splitlines() if line and not line.startswith(" ")]
    assert {"quickstart", "paper", "padding"} <= set(names), done.stdout


def test_the_benchmark_is_not_installed(venv):
    """`lit-packing bench` points at the checkout in one line (status 2); the package has no benchmark module."""
    done = run([str(venv["bin"] / "lit-packing"), "bench", "--smoke"], venv["env"], venv["work"])
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stdout.strip().splitlines() == [
        "error: the benchmark is not part of the installed package; run it from a checkout of the repository, "
        "from its root: python -m benchmarks"
    ]
    probe = "import importlib.util as u; print(u.find_spec('lit_packing.bench'), u.find_spec('benchmarks'))"
    lines = ok(run([str(venv["bin"] / "python"), "-c", probe], venv["env"], venv["work"])).stdout.splitlines()
    assert lines == ["None None"]
