"""Every setting the pages name exists: a `model.`, `data.` or `trainer.` key written in README.md or docs/ (in
backticks, as prose and tables write them) is an option of `fit`, so a renamed setting cannot live on in the docs.
The commands themselves run in tests/test_readme.py."""

import re
from pathlib import Path

import pytest

from lit_packing._compat import parser_options
from lit_packing.cli import LINKED, PackingCLI, cli_main

ROOT = Path(__file__).parents[1]
# The changelog names settings and attributes as they were.
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "migration.md")]
# A key in backticks, not a call (`trainer.init_module()`) and not a file name (`model.safetensors`).
KEY = re.compile(r"`(?:--)?((?:model|data|trainer)\.[A-Za-z_][\w.]*?)(?=[`=\s,:)\]])(?!\()")
FILES = (".safetensors", ".json", ".md", ".yaml", ".py")
# Settings that take a mapping: what is below them is the mapping's own keys (a model config, a LoRA config).
MAPPINGS = ("model.model_config", "model.lora")


@pytest.fixture(scope="module")
def options() -> set[str]:
    """The `fit` parser's options, without the leading `--`."""
    parsers = []

    def keep(self, parser, args):
        parsers.append(parser._subcommands_action._name_parser_map["fit"])  # noqa: SLF001
        raise SystemExit(0)

    original, PackingCLI.parse_arguments = PackingCLI.parse_arguments, keep
    try:
        with pytest.raises(SystemExit):
            cli_main(["fit"])
    finally:
        PackingCLI.parse_arguments = original
    return {option[2:] for option in parser_options(parsers[0]) if option.startswith("--")}


def known(key: str, options: set[str]) -> bool:
    """An option, a linked one, a key of a mapping setting, or a class's argument below one (`init_args`)."""
    if key in options or key in LINKED or key.endswith(FILES) or key.startswith(tuple(f"{m}." for m in MAPPINGS)):
        return True
    parent, _, rest = key.partition(".init_args")
    return bool(rest) and parent in options


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_setting_a_page_names_exists(page, options):
    unknown = sorted({key for key in KEY.findall(page.read_text()) if not known(key, options)})
    assert unknown == [], f"{page.name} names settings `fit` does not have: {unknown}"


def test_a_renamed_setting_would_be_caught(options):
    assert not known("data.max_lenght", options) and not known("model.cost_coefficients", options)
    assert known("data.max_length", options) and known("data.sampler.init_args.max_tokens", options)
