"""One test per `lit_packing._compat` function, on real objects: an upgrade that moves a private attribute fails here.

    pytest tests/test_compat.py   # "lightning 2.7.0 moved ...: update lit_packing/_compat.py" names what to fix

Each test checks the behaviour lit_packing relies on (not only that the attribute exists), with a real `Trainer`
fitting Lightning's demo `BoringModel`, a real offline W&B run, real `torch.compile`, a real tiny Llama, a real
`datasets.Dataset` and a real jsonargparse parser.
"""

from __future__ import annotations

import ast
import csv
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from torch.utils.data import BatchSampler, DataLoader, Sampler, SequentialSampler

from lit_packing import _compat
from lit_packing.preflight import read_checkpoint


def expect(ok: bool, library: str, what: str) -> None:
    """Fail with the message that names the library, its version, the moved attribute and the file to update."""
    assert ok, _compat.moved(library, what)


def trainer(tmp_path: Path, callbacks: list[pl.Callback], **kwargs) -> pl.Trainer:
    """A quiet CPU trainer for `BoringModel` (32 training batches per epoch)."""
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    return pl.Trainer(callbacks=callbacks, **{**defaults, **kwargs})


class Hook(pl.Callback):
    """Calls `record(hook_name, trainer, module, *args)` from the hooks it is given, and keeps what it returns."""

    def __init__(self, record: Callable, *hooks: str) -> None:
        self.record = record
        self.seen: list = []
        for hook in hooks:
            setattr(self, hook, functools.partial(self._call, hook))

    def _call(self, hook: str, trainer: pl.Trainer, module: pl.LightningModule, *args) -> None:
        self.seen.append(self.record(hook, trainer, module, *args))


# ----------------------------------------------------------------------------------------------------------------
# Lightning


class LoggingModel(BoringModel):
    def training_step(self, batch, batch_idx):
        output = super().training_step(batch, batch_idx)
        self.log("x", float(batch_idx), on_step=True, on_epoch=False)
        return output


def test_should_update_logs(tmp_path):
    """True at exactly the training steps whose `on_step` metrics reach the loggers."""
    callback = Hook(
        lambda hook, tr, module, *args: (tr.global_step, _compat.should_update_logs(tr)), "on_train_batch_end"
    )
    fit = trainer(tmp_path, [callback], max_steps=7, log_every_n_steps=3, logger=CSVLogger(tmp_path))
    fit.fit(LoggingModel())
    with open(Path(fit.logger.log_dir) / "metrics.csv") as file:
        logged = {int(row["step"]) + 1 for row in csv.DictReader(file) if row.get("x")}  # the step that just ran
    flagged = {step for step, flag in callback.seen if flag}
    expect(flagged == logged == {3, 6}, "lightning", "trainer._logger_connector.should_update_logs")


@pytest.fixture(scope="module")
def resumed_fit(tmp_path_factory):
    """A fit of 4 steps that saves a mid-epoch checkpoint at step 3, then a fit resumed from it to step 6.

    Returns: {"first": [(hook, batch_idx, trained, ready)], "resumed": [...]}.
    """
    tmp = tmp_path_factory.mktemp("resume")

    def record(hook, tr, module, *args):
        batch_idx = args[2] if hook == "on_train_batch_end" else None
        return hook, batch_idx, _compat.trained_batches(tr), _compat.ready_batches(tr)

    hooks = ("on_train_start", "on_train_batch_end", "on_save_checkpoint")
    first = Hook(record, *hooks)
    save = ModelCheckpoint(dirpath=tmp / "ckpt", filename="{step}", every_n_train_steps=3, save_top_k=-1)
    trainer(tmp, [first, save], max_steps=4, enable_checkpointing=True).fit(BoringModel())
    resumed = Hook(record, *hooks)
    trainer(tmp, [resumed], max_steps=6).fit(BoringModel(), ckpt_path=tmp / "ckpt" / "step=3.ckpt")
    return {"first": first.seen, "resumed": resumed.seen}


def test_trained_batches(resumed_fit):
    """The batches trained this epoch: `batch_idx + 1` at a batch end and in a checkpoint saved there; restored by
    a mid-epoch resume."""
    what = "fit_loop.epoch_loop.batch_progress.current.processed"
    first = resumed_fit["first"]
    ends = [(batch_idx, trained) for hook, batch_idx, trained, _ in first if hook == "on_train_batch_end"]
    expect(ends == [(i, i + 1) for i in range(4)], "lightning", what)
    saves = [trained for hook, _, trained, _ in first if hook == "on_save_checkpoint"]
    expect(saves == [3], "lightning", what)
    resumed = resumed_fit["resumed"]
    expect(resumed[0][:3] == ("on_train_start", None, 3), "lightning", what)
    after = [(batch_idx, trained) for hook, batch_idx, trained, _ in resumed if hook == "on_train_batch_end"]
    expect(after == [(3, 4), (4, 5), (5, 6)], "lightning", what)


def test_ready_batches(resumed_fit):
    """The batches fetched this epoch: 0 at a fresh start, the batches done before a mid-epoch resume."""
    what = "fit_loop.epoch_loop.batch_progress.current.ready"
    first, resumed = resumed_fit["first"], resumed_fit["resumed"]
    expect(first[0] == ("on_train_start", None, 0, 0), "lightning", what)
    ends = [(batch_idx, ready) for hook, batch_idx, _, ready in first if hook == "on_train_batch_end"]
    expect(ends == [(i, i + 1) for i in range(4)], "lightning", what)
    expect(resumed[0] == ("on_train_start", None, 3, 3), "lightning", what)


def test_accumulates(tmp_path):
    """From `on_train_batch_start`, accumulating 3 over an epoch of 64 batches: every batch but each third and the
    epoch's last (Lightning steps there whatever the count)."""
    callback = Hook(
        lambda hook, tr, module, batch, batch_idx: (batch_idx, _compat.accumulates(tr)), "on_train_batch_start"
    )
    trainer(tmp_path, [callback], max_epochs=1, accumulate_grad_batches=3).fit(BoringModel())
    stepping = [batch_idx for batch_idx, accumulating in callback.seen if not accumulating]
    expect(stepping == [*range(2, 64, 3), 63], "lightning", "fit_loop._should_accumulate")


def test_move_epoch_position(tmp_path_factory, resumed_fit):
    """Moved at `on_train_start` of a resume from batch 3 to batch 2 (accumulating 2): the next batch is index 2,
    the optimizer steps after batches 3 and 5, and the epoch ends at its own length."""
    tmp = tmp_path_factory.getbasetemp() / "resume0"

    def record(hook, tr, module, *args):
        if hook == "on_train_start":
            _compat.move_epoch_position(tr, 2)
        return hook, (args[2] if hook == "on_train_batch_end" else None), tr.global_step

    moved_to = Hook(record, "on_train_start", "on_train_batch_end")
    fit = trainer(tmp_path_factory.mktemp("moved"), [moved_to], max_steps=5, accumulate_grad_batches=2)
    fit.fit(BoringModel(), ckpt_path=tmp / "ckpt" / "step=3.ckpt")
    ends = [(batch_idx, step) for hook, batch_idx, step in moved_to.seen if hook == "on_train_batch_end"]
    what = "fit_loop.epoch_loop.batch_progress counters"
    expect(ends == [(2, 3), (3, 4), (4, 4), (5, 5)], "lightning", what)


def test_set_accumulate_grad_batches(tmp_path):
    """Set from `setup`: the optimizer steps every 3 batches, and `estimated_stepping_batches` counts with it."""

    seen = Hook(lambda hook, tr, module, *args: (hook, args[2], tr.global_step), "on_train_batch_end")

    class Stepping(BoringModel):
        def setup(self, stage):
            _compat.set_accumulate_grad_batches(self.trainer, 3)

        def configure_optimizers(self):
            self.estimated = self.trainer.estimated_stepping_batches
            return super().configure_optimizers()

    model = Stepping()
    trainer(tmp_path, [seen], max_epochs=1, limit_train_batches=7).fit(model)
    steps = [step for _, _, step in seen.seen]
    expect(steps == [0, 0, 1, 1, 1, 2, 3] and model.estimated == 3, "lightning", "Trainer.accumulate_grad_batches")


class ValidationSteps(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.validated_at: list[int] = []

    def on_validation_start(self) -> None:
        self.validated_at.append(self.trainer.global_step)


@pytest.mark.parametrize("every_epoch", [1, None], ids=["batches of the epoch", "batches of the fit"])
def test_validate_after_batch(tmp_path, every_epoch):
    """Written from `on_train_batch_end`, it decides each batch alone (Lightning's own cadence here: every 4 batches,
    the epoch's end), with the batches counted in the epoch or over the fit (`check_val_every_n_epoch=None`)."""

    def decide(hook, tr, module, *args):
        _compat.validate_after_batch(tr, tr.global_step in (3, 5, 6))

    model = ValidationSteps()
    fit = trainer(
        tmp_path, [Hook(decide, "on_train_batch_end")], max_steps=7, limit_train_batches=4, limit_val_batches=1,
        val_check_interval=4, check_val_every_n_epoch=every_epoch,
    )  # fmt: skip
    fit.fit(model)
    expect(model.validated_at == [3, 5, 6], "lightning", "trainer.val_check_batch")  # not 4


def test_validate_after_batch_refuses_a_missing_attribute():
    with pytest.raises(_compat.CompatError, match=r"lightning .* moved fit_loop.epoch_loop: update lit_packing"):
        _compat.validate_after_batch(object(), True)


def test_dummy_experiment():
    """A no-op stand-in for a W&B run: calls, items and attributes all do nothing; told apart from a real run."""
    experiment = _compat.dummy_experiment()
    what = "lightning.fabric.loggers.logger._DummyExperiment"
    expect(experiment.log({"loss": 1.0}) is None, "lightning", what)
    expect(experiment[0].add_image("x") is None, "lightning", what)
    expect(type(experiment).__name__ == "_DummyExperiment", "lightning", what)


def test_dummy_experiment_is_what_a_non_zero_rank_gets():
    """What a Lightning logger's `experiment` is on a rank other than 0: the stand-in `dummy_experiment` makes."""
    from lightning.pytorch.loggers.logger import rank_zero_experiment
    from lightning.pytorch.utilities import rank_zero_only

    previous, rank_zero_only.rank = rank_zero_only.rank, 1
    try:
        experiment = rank_zero_experiment(lambda self: object())(None)
    finally:
        rank_zero_only.rank = previous
    same = type(experiment) is type(_compat.dummy_experiment())
    expect(same, "lightning", "lightning.fabric.loggers.logger._DummyExperiment")


class EpochRecorder(Sampler[list]):
    """A batch sampler of batches of 4 that records the epochs Lightning sets."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(BatchSampler(SequentialSampler(range(self.n)), 4, drop_last=False))

    def __len__(self) -> int:
        return -(-self.n // 4)


class SamplerModel(BoringModel):
    def __init__(self, batch_sampler: Sampler) -> None:
        super().__init__()
        self.batch_sampler = batch_sampler
        self.batch_sizes: list[int] = []

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 10), batch_sampler=self.batch_sampler)

    def training_step(self, batch, batch_idx):
        self.batch_sizes.append(len(batch))
        return super().training_step(batch, batch_idx)


def test_batch_sampler_with_epoch(tmp_path):
    """Lightning calls the wrapped batch sampler's `set_epoch` at every epoch start; batches pass through."""
    recorder = EpochRecorder(10)
    wrapped = _compat.batch_sampler_with_epoch(recorder)
    model = SamplerModel(wrapped)
    trainer(tmp_path, [], max_epochs=3).fit(model)
    expect(len(wrapped) == 3 and model.batch_sizes == [4, 4, 2] * 3, "lightning", "DataLoader batch_sampler use")
    expect(recorder.epochs == [0, 1, 2], "lightning", "lightning.fabric.utilities.data._set_sampler_epoch")


def test_attached_trainer(tmp_path):
    """None before a fit (where `module.trainer` raises), the trainer during it."""
    model = BoringModel()
    expect(_compat.attached_trainer(model) is None, "lightning", "LightningModule._trainer")
    callback = Hook(lambda hook, tr, module: _compat.attached_trainer(module) is tr, "on_train_start")
    trainer(tmp_path, [callback], max_steps=1).fit(model)
    expect(callback.seen == [True], "lightning", "LightningModule._trainer")


class _Stop(Exception):
    pass


def test_cli_setting(tmp_path):
    """A config section, under the subcommand (`fit`) and without one (`run=False`)."""
    from lightning.pytorch.cli import LightningCLI

    found = {}

    class CLI(LightningCLI):
        def instantiate_trainer(self, **kwargs):
            found["trainer"] = _compat.cli_setting(self, self.config_init, "trainer", default={})
            found["absent"] = _compat.cli_setting(self, self.config_init, "absent", default="default")
            raise _Stop

    args = ["--trainer.max_steps=3", f"--trainer.default_root_dir={tmp_path}"]
    with pytest.raises(_Stop):
        CLI(BoringModel, args=["fit", *args])
    expect(found["trainer"].max_steps == 3 and found["absent"] == "default", "lightning", "LightningCLI._get")
    found.clear()
    with pytest.raises(_Stop):
        CLI(BoringModel, args=args, run=False)
    expect(found["trainer"].max_steps == 3, "lightning", "LightningCLI._get")


def test_wandb_logger_internals(tmp_path):
    """The `wandb.init` arguments, the run once created (a real offline run), and detaching it."""
    logger = WandbLogger(project="compat", save_dir=str(tmp_path), offline=True)
    kwargs = _compat.wandb_init_kwargs(logger)
    expect(kwargs["project"] == "compat" and kwargs["dir"] == str(tmp_path), "lightning", "WandbLogger._wandb_init")
    expect(_compat.wandb_run(logger) is None, "lightning", "WandbLogger._experiment")
    run = logger.experiment  # creates the run
    try:
        expect(_compat.wandb_run(logger) is run, "lightning", "WandbLogger._experiment")
        expect(_compat.detach_wandb_run(logger) is run, "lightning", "WandbLogger._experiment")
        expect(_compat.wandb_run(logger) is None and logger.version == run.id, "lightning", "WandbLogger._id")
        expect(_compat.detach_wandb_run(logger) is None, "lightning", "WandbLogger._experiment")
    finally:
        run.finish()


# ----------------------------------------------------------------------------------------------------------------
# torch


def test_compiled_graphs():
    """One more per compiled graph: a first call compiles, the same shape reuses it, a new shape recompiles."""
    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    before = _compat.compiled_graphs()
    what = 'torch._dynamo.utils.counters["stats"]["unique_graphs"]'
    compiled(torch.ones(2))
    expect(_compat.compiled_graphs() == before + 1, "torch", what)
    compiled(torch.ones(2))
    expect(_compat.compiled_graphs() == before + 1, "torch", what)
    compiled(torch.ones(3))
    expect(_compat.compiled_graphs() == before + 2, "torch", what)


def test_foreach_norm():
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2, dtype=torch.float64)]
    norms = _compat.foreach_norm(tensors)
    expected = [torch.linalg.vector_norm(t) for t in tensors]
    ok = len(norms) == 3 and all(n.dtype == e.dtype and torch.allclose(n, e) for n, e in zip(norms, expected))
    expect(ok, "torch", "torch._foreach_norm")


# ----------------------------------------------------------------------------------------------------------------
# transformers


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    return LlamaForCausalLM(config)


def test_attn_implementation_of(tiny_llama):
    """What `set_attn_implementation` set."""
    previous = _compat.attn_implementation_of(tiny_llama)
    try:
        for name in ("eager", "sdpa"):
            tiny_llama.set_attn_implementation(name)
            expect(_compat.attn_implementation_of(tiny_llama) == name, "transformers", "config._attn_implementation")
    finally:
        tiny_llama.set_attn_implementation(previous)


def test_supports_sdpa(tiny_llama):
    from transformers import PreTrainedModel

    what = "PreTrainedModel._supports_sdpa"
    expect(hasattr(PreTrainedModel, "_supports_sdpa"), "transformers", what)
    expect(_compat.supports_sdpa(tiny_llama) is True, "transformers", what)


def test_checkpoint_renaming(tiny_llama):
    """transformers' load-time renames: GPT-NeoX's stored `embed_out.` is the model's `lm_head.`; a Llama's names
    are its own; nothing of either is a converter's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.conftest import TINY_CONFIGS

    what = "core_model_loading.rename_source_key"
    neox = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_CONFIGS["gpt_neox"]))
    expect(_compat.checkpoint_renaming(neox)("embed_out.weight") == ("lm_head.weight", False), "transformers", what)
    same = _compat.checkpoint_renaming(tiny_llama)
    expect(all(same(name) == (name, False) for name in tiny_llama.state_dict()), "transformers", what)


NO_INTERFACE_MODEL = """
from torch import nn
from transformers import LlamaConfig, PreTrainedModel


class OwnAttention(nn.Module):  # computes attention itself, never through ALL_ATTENTION_FUNCTIONS
    pass


class OwnModel(PreTrainedModel):
    config_class = LlamaConfig
"""


def test_can_set_attn_implementation(tiny_llama, tmp_path, monkeypatch):
    """True for Llama (its attention goes through AttentionInterface), False for a model module whose attention
    class does not."""
    import importlib

    what = "PreTrainedModel._can_set_attn_implementation"
    expect(_compat.can_set_attn_implementation(tiny_llama) is True, "transformers", what)
    (tmp_path / "own_attention_model.py").write_text(NO_INTERFACE_MODEL)
    monkeypatch.syspath_prepend(tmp_path)
    module = importlib.import_module("own_attention_model")
    try:
        from transformers import LlamaConfig

        own = module.OwnModel(LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2))
        expect(_compat.can_set_attn_implementation(own) is False, "transformers", what)
    finally:
        sys.modules.pop("own_attention_model", None)


# ----------------------------------------------------------------------------------------------------------------
# datasets


def test_dataset_fingerprint(tmp_path):
    """Stable for the same data loaded twice; what `map(new_fingerprint=...)` set."""
    import datasets

    datasets.Dataset.from_dict({"text": ["a", "bb", "ccc"]}).save_to_disk(tmp_path / "data")
    first, again = (datasets.load_from_disk(tmp_path / "data") for _ in range(2))
    fingerprint = _compat.dataset_fingerprint(first)
    expect(
        len(fingerprint) > 0 and fingerprint == _compat.dataset_fingerprint(again), "datasets", "Dataset._fingerprint"
    )
    mapped = first.map(lambda row: {"n": len(row["text"])}, new_fingerprint="compat-test")
    expect(_compat.dataset_fingerprint(mapped) == "compat-test", "datasets", "Dataset._fingerprint")


# ----------------------------------------------------------------------------------------------------------------
# A Lightning checkpoint's loop state; jsonargparse's option list


def test_checkpoint_position(tmp_path):
    """Real checkpoints (64 batches an epoch) mid-epoch and at an epoch's end: step, epoch, epochs trained."""
    steps = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=33, save_top_k=-1)
    ends = ModelCheckpoint(dirpath=tmp_path, filename="end-{step}", save_top_k=-1, save_on_train_epoch_end=True)
    trainer(tmp_path, [steps, ends], max_steps=70, enable_checkpointing=True).fit(BoringModel())
    what = "checkpoint['loops']['fit_loop']['epoch_progress']"
    positions = {
        name: _compat.checkpoint_position(read_checkpoint(tmp_path / f"{name}.ckpt"))
        for name in ("step=33", "end-step=64", "step=66")
    }
    expect(positions == {"step=33": (33, 0, 0), "end-step=64": (64, 0, 1), "step=66": (66, 1, 1)}, "lightning", what)


def test_parser_options():
    """The option strings of a real jsonargparse parser, nested groups of a class included."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(ModelCheckpoint, "checkpoint")
    options = _compat.parser_options(parser)
    expect("--checkpoint.every_n_train_steps" in options, "jsonargparse", "ArgumentParser._actions")


def test_a_config_built_factory_takes_keywords():
    """What pyproject.toml's `jsonargparse>=4.41` stands for: a `Callable[[...], X]` setting given as class_path and
    init_args becomes a factory that also takes keyword arguments (the data module builds the validation sampler
    with `shuffle=False`); before 4.41 it took positional arguments only."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--factory", type=Callable[[Sampler], BatchSampler])
    spec = '{"class_path": "torch.utils.data.BatchSampler", "init_args": {"batch_size": 4, "drop_last": true}}'
    config = parser.parse_args([f"--factory={spec}"])
    factory = (getattr(parser, "instantiate", None) or parser.instantiate_classes)(config).factory
    built = factory(SequentialSampler(range(10)), drop_last=False)  # a keyword overrides the config's value
    assert list(built) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]], "jsonargparse factories must accept keywords"


def test_packaged_builders():
    """The builders `datasets` ships, by the names `load_dataset` takes (what a path that is no file is checked
    against before any Hub request)."""
    builders = _compat.packaged_builders()
    expect(
        {"json", "parquet", "arrow", "csv", "text"} <= builders,
        "datasets",
        "packaged_modules._PACKAGED_DATASETS_MODULES",
    )


LIBRARIES = {
    "torch",
    "lightning",
    "pl",
    "transformers",
    "datasets",
    "jsonargparse",
    "peft",
    "litdata",
    "wandb",
    "numba",
}


def _private_uses(tree: ast.AST) -> list[str]:
    """Dotted names of another library's private attributes (`torch._dynamo`, `from x import _y`) in a module."""
    found = []
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}  # part of a longer name
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            parts = [*node.module.split("."), *(alias.name for alias in node.names)]
            found += [f"{node.module}: {p}" for p in parts if p.startswith("_") and not p.startswith("__")]
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in LIBRARIES:
                name = ".".join([base.id, *reversed(chain)])
                if any(p.startswith("_") and not p.startswith("__") for p in chain):
                    found.append(name)
    return found


def test_every_private_attribute_of_another_library_is_read_in_compat():
    """`_compat.py` is the one module that reads another library's private names (each with a test here)."""
    package = Path(_compat.__file__).parent
    offenders = {
        str(path.relative_to(package)): uses
        for path in package.rglob("*.py")
        if path.name != "_compat.py" and (uses := _private_uses(ast.parse(path.read_text())))
    }
    assert offenders == {}
    assert _private_uses(ast.parse("import torch\ntorch._dynamo.reset()")) == ["torch._dynamo.reset"]  # it can fail


def test_mixer_kernels():
    """transformers' fallback wrapper of a mixer's packed kernels: the kernel's name, its package, whether it loads."""
    import importlib.util

    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.models.families import tiny_config

    bamba = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config("bamba")))
    found = {k.function: k for k in _compat.mixer_kernels(bamba.model.layers[0].mamba)}
    what = "integrations.hub_kernels.use_kernel_func_from_hub_with_fallback's wrapper"
    expect({"causal_conv1d_fn", "mamba_chunk_scan_combined"} <= set(found), "transformers", what)
    expect(found["causal_conv1d_fn"].package == "causal_conv1d", "transformers", what)
    expect(found["causal_conv1d_fn"].installed == bool(importlib.util.find_spec("causal_conv1d")), "transformers", what)
