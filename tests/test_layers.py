"""The package's two layers: a Lightning-free core that plain PyTorch and Hugging Face Trainer users import, and the
Lightning layer on top. The core imports nothing of the layers above it, no module imports upward, and the
module-level import graph has no cycle."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lit_packing"
# Layer of every module, lowest first; a module may import its own layer and the ones below.
CORE = ("lit_packing.batch", "lit_packing.cost", "lit_packing.errors", "lit_packing.text", "lit_packing._compat",
        "lit_packing.processes", "lit_packing.agree", "lit_packing.core",
        "lit_packing.samplers",
        "lit_packing.data.collate", "lit_packing.data.groups", "lit_packing.models.segments",
        "lit_packing.models.kernels",
        "lit_packing.models.backends", "lit_packing.models.attention", "lit_packing.models.loss",
        "lit_packing.models.mixers", "lit_packing.models.guard", "lit_packing.models.selftest",
        "lit_packing.models.probe", "lit_packing.models.pack", "lit_packing.models.head", "lit_packing.models.quantize",
        "lit_packing.models.optim",
        "lit_packing.models.weights", "lit_packing.models.sharding", "lit_packing.models.preference",
        "lit_packing.models.grpo", "lit_packing.models.context", "lit_packing.models.vlm")  # fmt: skip
LIGHTNING = ("lit_packing.assets", "lit_packing.loggers", "lit_packing.contract", "lit_packing.checkpoint_io",
             "lit_packing.strategies",
             "lit_packing.data", "lit_packing.models", "lit_packing.callbacks", "lit_packing.configs")  # fmt: skip
CLI = ("lit_packing.cli", "lit_packing.preflight", "lit_packing.runs", "lit_packing.checkpoint_export")
TOOLS = ("lit_packing.packing_report",)  # the benchmark is not in the package: benchmarks/ in the checkout
COMMANDS = ("lit_packing.commands", "lit_packing.__main__")  # the `lit-packing` command: every tool by name
LAYERS = (CORE, LIGHTNING, CLI, TOOLS, COMMANDS)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> int:
    """The layer of a module: the most specific prefix listed wins (`lit_packing.data.collate` is core)."""
    if module == "lit_packing":
        return 0  # the root package holds its version and docstring only
    best = max(
        ((len(prefix), i) for i, names in enumerate(LAYERS) for prefix in names
         if module == prefix or module.startswith(prefix + ".")),
        default=None,
    )  # fmt: skip
    if best is None:
        raise AssertionError(f"{module} has no layer: add it to one in tests/test_layers.py")
    return best[1]


def imports(module: str, top_level_only: bool) -> set[str]:
    """The lit_packing modules `module` imports (a `from package import submodule` counts as the submodule);
    `TYPE_CHECKING` blocks never count; function bodies count unless `top_level_only`."""
    tree = ast.parse(MODULES[module].read_text())
    found: set[str] = set()

    def visit(nodes, top: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("lit_packing"))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lit_packing"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in MODULES else node.module)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and top_level_only:
                if isinstance(node, ast.ClassDef):
                    visit(node.body, top)
                continue
            children = [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
            visit(children, top)

    visit(tree.body, True)
    found.discard(module)
    return found


def test_every_module_has_a_layer_and_imports_none_above_it():
    upward = [
        f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})"
        for module in MODULES
        for target in sorted(imports(module, top_level_only=False))
        if layer(target) > layer(module)
    ]
    assert not upward, "\n".join(upward)


def import_cycles(graph: dict[str, set[str] | list[str]]) -> list[str]:
    """Every cycle a depth-first walk of the import graph meets, as `a -> b -> a` (also used by tests/bench)."""
    state: dict[str, str] = {}
    cycles = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                walk(nxt, [*path, nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    return cycles


def test_module_level_imports_have_no_cycle():
    graph = {m: {t for t in imports(m, top_level_only=True) if t in MODULES} for m in MODULES}
    cycles = import_cycles(graph)
    assert not cycles, "\n".join(cycles)


BLOCK_LIGHTNING = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics", "jsonargparse"):
            raise ImportError(f"{name} is blocked: the core must not need it")
sys.meta_path.insert(0, Block())
"""


CORE_MODULES = [m for m in MODULES if layer(m) == 0]


@pytest.fixture(scope="module")
def core_imports() -> dict[str, str]:
    """Each core module imported in one process with Lightning made unimportable (blocked for the whole process,
    so a module that needs Lightning fails whichever imported first): module -> `ok` or its error."""
    code = (
        BLOCK_LIGHTNING
        + f"""
import importlib, json, traceback
results = {{}}
for module in {CORE_MODULES!r}:
    try:
        results[module] = "ok" if importlib.import_module(module).__name__ == module else "another module"
    except Exception:
        results[module] = traceback.format_exc()[-2000:]
print(json.dumps(results))
"""
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_module_imports_without_lightning(module, core_imports):
    """Each core module imports, and its worked examples' names resolve, with Lightning made unimportable."""
    assert core_imports[module] == "ok", core_imports[module]


def test_core_packs_collates_and_computes_the_loss_without_lightning():
    """A plain-PyTorch user's path end to end: plan packs, collate one, run the packed loss on logits."""
    code = (
        BLOCK_LIGHTNING
        + """
import numpy as np, torch
from lit_packing.samplers import BestFitPackingSampler
from lit_packing.data.collate import PackedCollator
from lit_packing.models.loss import causal_lm_loss
from lit_packing.batch import attach_step
lengths = np.array([5, 9, 3, 7])
pack = next(iter(BestFitPackingSampler(lengths, max_tokens=16, seed=0)))
batch = attach_step([PackedCollator()([{"input_ids": list(range(1, int(lengths[i]) + 1))} for i in pack])])[0]
parts = causal_lm_loss(torch.randn(1, batch["input_ids"].shape[1], 20), batch, "token")
assert "lightning" not in sys.modules
print("ok", float(parts.label_tokens))
"""
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("ok"), result.stderr[-2000:]


def test_the_models_import_nothing_of_the_data_package():
    """The model side reads the data only through the contract and the core's batch format (`StepShape` included),
    never `lit_packing.data`: anywhere in its modules, function bodies included."""
    found = {
        module: sorted(t for t in imports(module, top_level_only=False) if t.startswith("lit_packing.data"))
        for module in MODULES
        if module.startswith("lit_packing.models")
    }
    assert {module: targets for module, targets in found.items() if targets} == {}


def test_no_module_imports_another_modules_private_name():
    """A name with a leading underscore is its module's own: a second user makes it public (one home per concept)."""
    private = [
        f"{module} imports {node.module}.{alias.name}"
        for module, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lit_packing")
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert not private, "\n".join(private)
