"""The documentation's commands: every shell command in the ```bash blocks of README.md and of every page under
docs/ runs here, so the pages cannot drift from the code.

How each command is checked (smoke-sized, in one scratch folder, page by page: README.md first, then docs/*.md by
name, each in its own order, so that `--ckpt_path` finds the checkpoint an earlier `fit` on the same page wrote):
- `python main.py ...`: run in-process through `cli_main` with the command's own arguments, then a tiny random
  model of SmolLM2's shape and a short run appended (`--trainer.max_steps=2 --data.limit=64`; an image-chat config
  runs a tiny vision-language model around it, on 32 questions). The own-data example
  runs with only the tiny model appended, on a 30-chat file, so its validation split and cadence are the ones the
  page shows. Commands that need a GPU or the Hub (`configs/gpu.yaml`, a Hub model name) and the `main.py`
  command inside a multi-node launcher (`torchrun`, `srun`) are checked for parse errors only (`--print_config`):
  this suite runs on CPU without network.
- `lit-packing fit|validate|test|report ...` (the installed command): as `python main.py ...` and
  `python -m lit_packing.packing_report ...`; one that names the same configs and settings as a `python main.py`
  command of the same page (a config by name, the other by path) is checked for parse errors only: that run is the
  other's, and the installed entry point itself runs in tests/test_install.py.
- `lit-packing export ...`: run as written, in-process, on the checkpoint an earlier `fit` of the page wrote; the
  folder it writes must hold a config and safetensors weights.
- `python -m lit_packing.packing_report ...`: run as written. `python -m benchmarks ...`: its settings parsed and
  checked (the benchmark itself runs, smoke-sized, in tests/bench/).
- `python -m benchmarks.<name> ...`: `--help`, and every option the page passes must be one the script accepts.
- `bash benchmarks/*.sh`: `bash -n` (syntax; the script needs a GPU). `make <target>`: `make -n` (the target exists;
  running it would create a virtual environment).
- `sbatch FILE`: the file exists, `bash -n` passes, its `#SBATCH` lines come before its first command (sbatch reads
  no later ones), and the `main.py` command of each `srun` line in it parses, as a launcher's does.
- `pip install ...`: nothing installed; `.` or `.[extras]` must name extras `pyproject.toml` declares, and any other
  requirement must be pinned exactly as `pyproject.toml`'s dependencies or the Makefile (`TORCH`, `ASSETS`) pin it.
- `wandb ...`: listed in NOT_RUN with the reason; any other command fails the test until it is classified.
A documented option the CLI rejects makes jsonargparse exit with an error, which fails the test. Each command is
written once in all the pages together (a page links to another's command instead of repeating it), so each runs
once; and every relative link of every page points at a file that exists, and at a heading of it that exists.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lit_packing.cli import cli_main
from lit_packing.data import OnPolicyRollouts
from tests.conftest import TINY

ROOT = Path(__file__).parents[1]
SHORT = ["--trainer.max_steps=2", "--data.limit=64"]
LAUNCHERS = ("torchrun", "srun")  # multi-node launchers: need the GPUs and nodes they name
NOT_RUN = {
    "wandb login": "needs a W&B account and the network",
    "wandb sync": "uploads a run: needs the network",
}


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def page_commands(page: Path) -> list[list[str]]:
    """Every command of a page's ```bash blocks, continuation lines joined, comments dropped, split by shlex."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def documented_commands() -> list[tuple[str, list[str]]]:
    """(page, command) for every page, README.md first, then docs/*.md by name."""
    return [(str(page.relative_to(ROOT)), words) for page in PAGES for words in page_commands(page)]


DOCUMENTED = documented_commands()
COMMANDS = [words for _, words in DOCUMENTED]


def own_data_file(folder: Path, n: int = 30) -> None:
    """`my_chats.jsonl`: n short chats under a `conversation` key, as the own-data example reads."""
    with open(folder / "my_chats.jsonl", "w") as f:
        for i in range(n):
            chat = [
                {"role": "user", "content": f"What is {i} + {i}?"},
                {"role": "assistant", "content": f"{i} + {i} = {2 * i}."},
            ]
            f.write(json.dumps({"conversation": chat}) + "\n")


def own_pairs_file(folder: Path, n: int = 40) -> None:
    """`my_pairs.jsonl`: n preference pairs (prompt, chosen, rejected), as the preference page's example reads."""
    with open(folder / "my_pairs.jsonl", "w") as f:
        for i in range(n):
            pair = {
                "prompt": f"What is {i} + {i}?",
                "chosen": f"{i} + {i} = {2 * i}.",
                "rejected": f"It is {2 * i + 1}.",
            }
            f.write(json.dumps(pair) + "\n")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """One folder for every command: configs/ linked in, the own-data file, runs/ written as a user's would be."""
    folder = tmp_path_factory.mktemp("first_hour")
    (folder / "configs").symlink_to(ROOT / "configs")
    (folder / "benchmarks").symlink_to(ROOT / "benchmarks")
    own_data_file(folder)
    own_pairs_file(folder)
    return folder


def test_the_pages_show_the_commands_this_test_knows():
    programs = {" ".join(words[:2]) for words in COMMANDS}
    assert {"python main.py", "python -m", "make run", "make test"} <= programs
    assert {"make run", "make test"} <= {" ".join(words) for words in page_commands(ROOT / "README.md")}, "README"
    assert any("HFDataset" in " ".join(words) for words in COMMANDS), "the own-data example"
    assert any("--ckpt_path" in " ".join(words) for words in COMMANDS), "validate/test on a fine-tuned model"


def test_each_command_is_written_once():
    seen: dict[str, str] = {}
    for page, words in DOCUMENTED:
        command = " ".join(words)
        assert command not in seen, f"{command!r} is in {seen.get(command)} and {page}: link to it instead"
        seen[command] = page


def test_the_readme_links_every_page():
    linked = {target for target, _ in links(ROOT / "README.md")}
    for page in PAGES[1:]:
        assert str(page.relative_to(ROOT)) in linked, f"README.md does not link {page.name}"


def anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def links(page: Path) -> list[tuple[str, str]]:
    """(target relative to the repository root, #fragment or "") of every relative link and image of a page."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    found = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        found.append((str(file.relative_to(ROOT)), fragment))
    return found


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_links_resolve(page):
    for target, fragment in links(page):
        assert (ROOT / target).exists(), f"{page.name} links to {target}, which does not exist"
        if fragment:
            text = re.sub(r"```.*?```", "", (ROOT / target).read_text(), flags=re.S)
            ids = {anchor(h) for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}
            assert fragment in ids, f"{page.name} links to {target}#{fragment}: no such heading"


def output(capsys) -> str:
    """The end of what a command printed (every toolkit line is on stdout; third-party warnings on stderr)."""
    captured = capsys.readouterr()
    return (captured.out + captured.err)[-2000:]


def main_py_args(words: list[str]) -> tuple[list[str], bool]:
    """The `cli_main` arguments for a documented `python main.py ...` command, and whether it is parse-only."""
    args = words[2:]
    joined = " ".join(args)
    if "--print_config" in args:
        return args, True
    if "configs/gpu.yaml" in joined or "--config gpu" in joined:  # a GPU (and here a Hub model): parse errors only
        return [*args, "--print_config"], True
    if any(arg.startswith("--trainer.devices=") and arg.split("=", 1)[1] not in ("1", "auto") for arg in args):
        # several processes: Lightning's launcher would start this test's own command again for each rank (the
        # sharded launch runs through the CLI in tests/models/test_sharding.py); here its config must parse
        return [*args, "--print_config"], True
    extra = [f"--model.model_config={json.dumps(TINY)}"]
    if "--model.name_or_path=" in joined:  # a local folder a page's command wrote (an export): its own weights
        extra = []
    if "configs/vlm.yaml" in joined:  # image chats: a tiny VLM around the tiny model (a text model reads no image)
        from tests.cli.test_configs import saved_tiny_vlm

        folder = Path("vlm_model") / "tiny_vlm"  # in the page's scratch folder: built once
        folder = folder if folder.is_dir() else saved_tiny_vlm(Path("vlm_model"))
        extra = [f"--model.name_or_path={folder.resolve()}", "--data.source.init_args.limit=32",
                 "--data.sampler.init_args.max_tokens=300"]  # 2 chats a step  # fmt: skip
    if "HFDataset" not in joined:  # the own-data example runs as written, on its 30 chats
        resumes = "--ckpt_path" in joined and "--trainer.max_steps" in joined  # continues a run: its own limit
        extra += [arg for arg in SHORT if not (resumes and arg.startswith("--trainer.max_steps"))]
    return [*args, *extra], False


@pytest.mark.slow
@pytest.mark.parametrize(("page", "words"), DOCUMENTED, ids=[f"{p}: {' '.join(w)}"[:100] for p, w in DOCUMENTED])
def test_documented_command_runs(page, words, scratch, monkeypatch, capsys, every_core):
    monkeypatch.chdir(scratch)
    command = " ".join(words)
    while re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # `NAME=value command ...`: the command, in that environment
        name, value = words[0].split("=", 1)
        monkeypatch.setenv(name, value)
        words = words[1:]
    if words[0] == "lit-packing":  # the installed command: the same entry as `python main.py` (tests/test_install.py)
        if words[1] in ("fit", "validate", "test") and same_as_a_run(page, words[1:]):
            with pytest.raises(SystemExit) as exit_info:
                cli_main([*words[1:], "--print_config"])
            assert exit_info.value.code in (0, None), f"{command}: {output(capsys)}"
            return
        words = ["python", "main.py", *words[1:]] if words[1] in ("fit", "validate", "test") else words
    if words[:2] == ["lit-packing", "report"]:
        words = ["python", "-m", "lit_packing.packing_report", *words[2:]]
    if words[:2] == ["python", "main.py"]:
        args, parse_only = main_py_args(words)
        if parse_only:
            with pytest.raises(SystemExit) as exit_info:
                cli_main(args)
            assert exit_info.value.code in (0, None), f"{command}: {output(capsys)}"
            return
        cli = cli_main(args)
        assert cli.trainer.state.finished, command
        if words[2] == "fit":  # trained, and validated on the held-out split its config's fractions give (an
            # on-policy run holds nothing out: it logs the reward of the rounds it sampled)
            logged = "rollout/reward" if isinstance(cli.datamodule.source, OnPolicyRollouts) else "val/loss"
            assert cli.trainer.global_step > 0 and logged in cli.trainer.callback_metrics, command
    elif words[0] in LAUNCHERS:  # a multi-node GPU recipe: the main.py command it launches must parse
        launched_command_parses(words, command, capsys)
    elif words[:2] == ["lit-packing", "export"]:  # on the checkpoint an earlier fit of this page wrote
        from lit_packing.commands import export

        try:
            export(words[2:])
        except SystemExit as error:
            pytest.fail(f"{command}: exit status {error.code}: {output(capsys)}")
        folder = Path(option_value(words, "--output"))
        assert (folder / "config.json").is_file() and any(folder.glob("*.safetensors")), f"{command}: {folder}"
    elif words[0] == "sbatch":
        batch_script_checks(ROOT / words[1], command, capsys)
    elif words[:2] == ["pip", "install"]:
        pip_requirements_known(words[2:], command)
    elif words[:3] == ["python", "-m", "lit_packing.packing_report"]:
        from lit_packing.packing_report import main

        assert main(words[3:])
    elif words[:3] == ["python", "-m", "benchmarks"]:
        from benchmarks.run import parse

        assert parse(words[3:]).rounds >= 1
    elif words[:2] == ["python", "-m"] and words[2].startswith("benchmarks."):  # from the root, as the pages say
        shown = run([sys.executable, "-m", words[2], "--help"], cwd=ROOT).stdout
        for option in (w.split("=")[0] for w in words[3:] if w.startswith("--")):
            assert option in shown, f"{command}: {words[2]} has no {option}"
    elif words[0] == "bash":
        run(["bash", "-n", str(ROOT / words[1])])
    elif words[0] == "make":
        run(["make", "-n", "-C", str(ROOT), *words[1:]])
    else:
        assert " ".join(words[:2]) in NOT_RUN, f"{page}: command not checked by any rule here: {command}"


def launched_command_parses(words: list[str], command: str, capsys) -> None:
    """The `main.py` command a launcher line (`torchrun ... main.py fit ...`, `srun python main.py fit ...`) runs
    parses with `--print_config`: a multi-node GPU run cannot run here."""
    args = [*words[words.index("main.py") + 1 :], "--print_config"]
    with pytest.raises(SystemExit) as exit_info:
        cli_main(args)
    assert exit_info.value.code in (0, None), f"{command}: {output(capsys)}"


def option_value(words: list[str], option: str) -> str:
    """The value of `--option VALUE` or `--option=VALUE` in a command."""
    for i, word in enumerate(words):
        if word == option:
            return words[i + 1]
        if word.startswith(f"{option}="):
            return word.split("=", 1)[1]
    raise AssertionError(f"{' '.join(words)}: no {option}")


def batch_script_checks(script: Path, command: str, capsys) -> None:
    """A SLURM batch script: it exists, its syntax is bash's, every `#SBATCH` line comes before the first command,
    and each `srun ... main.py ...` line launches a command that parses."""
    assert script.is_file(), f"{command}: no such file {script}"
    run(["bash", "-n", str(script)])
    lines = script.read_text().replace("\\\n", " ").splitlines()
    commands = [i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")]
    directives = [i for i, line in enumerate(lines) if line.startswith("#SBATCH")]
    assert directives and commands and max(directives) < min(commands), f"{command}: #SBATCH after a command"
    launches = [expanded(lines[i]) for i in commands if lines[i].lstrip().startswith("srun ")]
    assert launches and all("main.py" in words for words in launches), f"{command}: no srun ... main.py line"
    for words in launches:
        launched_command_parses(words, command, capsys)


def expanded(line: str) -> list[str]:
    """A script's command as bash splits and expands it where the user set none of its variables (each takes its
    default: `${RUN_CONFIG:+--config "$RUN_CONFIG"}` adds nothing)."""
    done = subprocess.run(["bash", "-c", f'set -- {line}\nprintf "%s\\0" "$@"'], capture_output=True, text=True,
                          timeout=30, env={})  # fmt: skip
    assert done.returncode == 0, f"{line}: {done.stderr}"
    return done.stdout.split("\0")[:-1]


def pip_requirements_known(args: list[str], command: str) -> None:
    """`pip install` arguments: `.` / `.[extras]` name extras pyproject.toml declares; any other requirement is
    pinned as pyproject.toml's dependencies or the Makefile's `TORCH` / `ASSETS` pin it (so the page cannot drift)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    made = re.findall(r"^(?:TORCH \?=|ASSETS :=) (.+)$", (ROOT / "Makefile").read_text(), flags=re.M)
    pins: dict[str, list] = {}  # torch: pyproject.toml's range and the Makefile's exact version
    for pinned in [*map(Requirement, project["dependencies"]), *map(Requirement, " ".join(made).split())]:
        pins.setdefault(canonicalize_name(pinned.name), []).append(pinned.specifier)
    targets, value_next = [], False
    for arg in args:  # requirements, and the value of -e; other options (--no-deps, ...) install nothing by themselves
        if value_next or not arg.startswith("-"):
            targets.append(arg)
        value_next = arg in ("-e", "--editable")
    assert targets, f"{command}: installs nothing"
    for target in targets:
        if target == "." or target.startswith(".["):
            extras = Requirement(f"lit_packing{target[1:]}").extras
            unknown = extras - set(project["optional-dependencies"])
            assert not unknown, f"{command}: pyproject.toml has no extra {sorted(unknown)}"
            continue
        requirement = Requirement(target)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{command}: {requirement.name} is pinned neither in pyproject.toml nor in the Makefile"
        shown = " or ".join(f"{name}{specifier}" for specifier in pins[name])
        assert requirement.specifier in pins[name], f"{command}: {target}, but the project pins {shown}"


def same_as_a_run(page: str, args: list[str]) -> bool:
    """Whether a `python main.py` command of `page` names the same configs (by name or by path) and settings."""
    from lit_packing.configs import resolve_config_args

    def resolved(words: list[str]) -> list[str]:
        return [str((ROOT / w).resolve()) if w.endswith(".yaml") else w for w in resolve_config_args(list(words))]

    mine = resolved(args)
    return any(words[:2] == ["python", "main.py"] and resolved(words[2:]) == mine
               for other, words in DOCUMENTED if other == page)  # fmt: skip


def run(argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=cwd)
    assert done.returncode == 0, f"{' '.join(argv)}: {done.stderr[-2000:]}"
    return done
