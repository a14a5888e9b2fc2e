"""The README's first hour: every shell command in README.md's ```bash blocks runs here, so the README cannot
drift from the code.

How each command is checked (smoke-sized, in one scratch folder, in README order so that `--ckpt_path` finds the
checkpoint an earlier `fit` wrote):
- `python main.py ...`: run in-process through `cli_main` with the command's own arguments, then a tiny random
  model of SmolLM2's shape and a short run appended (`--trainer.max_steps=2 --data.limit=64`). The own-data example
  runs with only the tiny model appended, on a 30-chat file, so its validation split and cadence are the ones the
  README shows. Commands that need a GPU or the Hub (`configs/gpu.yaml`, a Hub model name) and the `main.py`
  command inside a multi-node launcher (`torchrun`, `srun`) are checked for parse errors only (`--print_config`):
  this suite runs on CPU without network.
- `python -m lit_packing.packing_report ...`: run as written. `python -m lit_packing.bench ...`: its settings parsed and
  checked (the benchmark itself runs, smoke-sized, in tests/bench/).
- `python benchmarks/*.py ...`: `--help`, and every option the README passes must be one the script accepts.
- `bash benchmarks/*.sh`: `bash -n` (syntax; the script needs a GPU). `make <target>`: `make -n` (the target exists;
  running it would create a virtual environment).
- `wandb ...`: listed in NOT_RUN with the reason; any other command fails the test until it is classified.
A README option the CLI rejects makes jsonargparse exit with an error, which fails the test.
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

ROOT = Path(__file__).parents[1]
TINY = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 8192, "tie_word_embeddings": True,
}  # fmt: skip
SHORT = ["--trainer.max_steps=2", "--data.limit=64"]
LAUNCHERS = ("torchrun", "srun")  # multi-node launchers: need the GPUs and nodes they name
NOT_RUN = {
    "wandb login": "needs a W&B account and the network",
    "wandb sync": "uploads a run: needs the network",
}


def readme_commands() -> list[list[str]]:
    """Every command of README.md's ```bash blocks, continuation lines joined, comments dropped, split by shlex."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


COMMANDS = readme_commands()


def own_data_file(folder: Path, n: int = 30) -> None:
    """`my_chats.jsonl`: n short chats under a `conversation` key, as the README's own-data example reads."""
    with open(folder / "my_chats.jsonl", "w") as f:
        for i in range(n):
            chat = [
                {"role": "user", "content": f"What is {i} + {i}?"},
                {"role": "assistant", "content": f"{i} + {i} = {2 * i}."},
            ]
            f.write(json.dumps({"conversation": chat}) + "\n")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """One folder for every command: configs/ linked in, the own-data file, runs/ written as a user's would be."""
    folder = tmp_path_factory.mktemp("first_hour")
    (folder / "configs").symlink_to(ROOT / "configs")
    (folder / "benchmarks").symlink_to(ROOT / "benchmarks")
    own_data_file(folder)
    return folder


def test_the_readme_shows_the_commands_this_test_knows():
    programs = {" ".join(words[:2]) for words in COMMANDS}
    assert {"python main.py", "python -m", "make run", "make test"} <= programs
    assert any("HFDataset" in " ".join(words) for words in COMMANDS), "the own-data example"
    assert any("--ckpt_path" in " ".join(words) for words in COMMANDS), "validate/test on a fine-tuned model"


def main_py_args(words: list[str]) -> tuple[list[str], bool]:
    """The `cli_main` arguments for a README `python main.py ...` command, and whether it is parse-only."""
    args = words[2:]
    joined = " ".join(args)
    if "--print_config" in args:
        return args, True
    if "configs/gpu.yaml" in joined:  # a GPU (and here a Hub model): parse errors only
        return [*args, "--print_config"], True
    extra = [f"--model.model_config={json.dumps(TINY)}"]
    if "--model.name_or_path=" in joined:  # a local folder the README wrote (an export): its own weights
        extra = []
    if "HFDataset" not in joined:  # the own-data example runs as written, on its 30 chats
        extra += SHORT
    return [*args, *extra], False


@pytest.mark.slow
@pytest.mark.parametrize("words", COMMANDS, ids=[" ".join(w)[:80] for w in COMMANDS])
def test_readme_command_runs(words, scratch, monkeypatch, capsys):
    monkeypatch.chdir(scratch)
    command = " ".join(words)
    if words[:2] == ["python", "main.py"]:
        args, parse_only = main_py_args(words)
        if parse_only:
            with pytest.raises(SystemExit) as exit_info:
                cli_main(args)
            assert exit_info.value.code in (0, None), f"{command}: {capsys.readouterr().err[-2000:]}"
            return
        cli = cli_main(args)
        assert cli.trainer.state.finished, command
        if words[2] == "fit":  # trained, and validated on the held-out split its config's fractions give
            assert cli.trainer.global_step > 0 and "val/loss" in cli.trainer.callback_metrics, command
    elif words[0] in LAUNCHERS:  # a multi-node GPU recipe: the main.py command it launches must parse
        args = [*words[words.index("main.py") + 1 :], "--print_config"]
        with pytest.raises(SystemExit) as exit_info:
            cli_main(args)
        assert exit_info.value.code in (0, None), f"{command}: {capsys.readouterr().err[-2000:]}"
    elif words[:3] == ["python", "-m", "lit_packing.packing_report"]:
        from lit_packing.packing_report import main

        assert main(words[3:])
    elif words[:3] == ["python", "-m", "lit_packing.bench"]:
        from lit_packing.bench.run import parse

        assert parse(words[3:]).rounds >= 1
    elif words[0] == "python" and words[1].startswith("benchmarks/"):
        shown = run([sys.executable, words[1], "--help"]).stdout
        for option in (w.split("=")[0] for w in words[2:] if w.startswith("--")):
            assert option in shown, f"{command}: {words[1]} has no {option}"
    elif words[0] == "bash":
        run(["bash", "-n", str(ROOT / words[1])])
    elif words[0] == "make":
        run(["make", "-n", "-C", str(ROOT), *words[1:]])
    else:
        assert " ".join(words[:2]) in NOT_RUN, f"README command not checked by any rule here: {command}"


def run(argv: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(argv)}: {done.stderr[-2000:]}"
    return done
