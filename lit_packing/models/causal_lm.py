"""`PackedCausalLM`: a LightningModule that fine-tunes a transformers causal LM on packed (or padded) batches.

    lm = PackedCausalLM(name_or_path="smollm2", attn_backend="auto", lr=2e-5)
    Trainer(precision="bf16-mixed", accumulate_grad_batches=4).fit(lm, datamodule=dm)

What it adds to a plain `AutoModelForCausalLM` (built by `loading.build_model`, made packed by `pack.pack_model`):
- a varlen attention backend reading `cu_seq_lens_*` (see `attention.py`); padded batches run sdpa with their mask;
- the loss computed here from the last hidden states chunk by chunk (the (T, V) logits are never built), as one
  global mean over every gradient-accumulation micro-batch and every data-parallel rank (`loss_normalization`), so
  packing never changes the gradient: each micro-batch's loss sum is divided by its optimizer step's global label
  count, which every batch carries (`batch["step"]`, from the sampler's global plan), so no gradient is ever
  rescaled and no rank communicates for it;
- a memory estimate of the largest step before the first one, and the largest step that fits for
  `max_tokens: auto` / `batch_size: auto` (`largest_fitting`; see `memory.py`);
- a host-side check of every batch (`guard.py`) and an isolation self-test before the first step (`selftest.py`);
- numerics guards: a non-finite loss or gradient stops the run naming the step (`nonfinite=error`) or skips the
  step and counts it (`skip`, logged as `train/nonfinite_steps`); `export` refuses non-finite weights; token ids
  outside the embedding table are refused at setup;
- validation metrics (`val/loss`, `val/perplexity`, `val/token_accuracy`) that packed and padded batches agree on.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torchmetrics
from lightning.pytorch import Callback, LightningModule
from tqdm.auto import tqdm

from lit_packing._compat import accumulates, attached_trainer, compiled_graphs, foreach_norm
from lit_packing.assets import resolve_pretrained
from lit_packing.batch import LABELS, ROWS, STEP, StepShape, is_packed, model_inputs
from lit_packing.contract import DataContract, DataModelConnection, ModelContract, PairSplit
from lit_packing.cost import model_shape
from lit_packing.errors import AssetError, ConfigError, DataError, TrainingError, check_range
from lit_packing.models.backends import AttnBackend, VarlenImpl, precision_note, select_varlen_impl
from lit_packing.models.export import export_model, export_sharded
from lit_packing.models.guard import check_packed_batch
from lit_packing.models.head import check_liger, head_inputs
from lit_packing.models.loading import DType, build_model, finish_build
from lit_packing.models.loss import (
    HeadInputs,
    LossImpl,
    LossNormalization,
    LossParts,
    causal_lm_loss,
    check_loss_settings,
    eval_sums,
)
from lit_packing.models.materialize import (
    LORA_SETTING,
    Weights,
    deferring,
    host_memory_returned,
    initialize,
    is_meta,
    local_folder,
    lora_init_supported,
    materialize,
)
from lit_packing.models.memory import (
    MemoryEstimate,
    check_fit_memory,
    choose_largest_fitting,
    increasing,
    memory_model,
)
from lit_packing.models.mixers import MixerChoice
from lit_packing.models.optim import lr_schedule, parameter_groups
from lit_packing.models.pack import pack_model
from lit_packing.models.preference import (
    PreferenceParts,
    pair_logps,
    preference_loss,
    preference_metrics,
    preference_settings,
)
from lit_packing.models.reference import (
    CHECKPOINT_KEY,
    ReferenceTable,
    read_table,
    table_key,
    weights_fingerprint,
    write_table,
)
from lit_packing.models.selftest import check_isolation
from lit_packing.models.sharding import (
    clip_grad_norm,
    data_parallel_mesh,
    is_sharded,
    local_tensor,
    reshard,
    shard_count,
    shard_model,
    sync_gradients,
    tensor_parallel_plan,
    tensor_parallel_size,
)
from lit_packing.models.weights import describe_model, weights_mismatch
from lit_packing.text import count

log = logging.getLogger(__name__)

# The strategies whose gradient reduction this loss is tested under: DDP and FSDP1 average gradients over ranks;
# ModelParallelStrategy (FSDP2, `configure_model`) is set to sum them (`sharding.shard_model`).
# By class name, exactly: a subclass may change how gradients are reduced. ShardedStrategy is ModelParallelStrategy
# with atomic checkpoints (`lit_packing.strategies`), which the CLI runs in its place.
TESTED_STRATEGIES = ("SingleDeviceStrategy", "DDPStrategy", "FSDPStrategy", "ModelParallelStrategy", "ShardedStrategy")
SUMMING_STRATEGIES = ("ModelParallelStrategy", "ShardedStrategy")
Schedule = Literal["cosine", "linear", "constant"]
NonFinite = Literal["error", "skip"]
SAMPLE_ROWS = 8  # source rows named when a step fails
# Core parameters that are `model.<name>` settings (a core `ConfigError` naming one is re-raised with that path).
MODEL_SETTINGS = ("attn_backend", "varlen_impl", "mixers", "loss_impl", "loss_normalization", "loss_chunk_size",
                  "objective", "beta", "simpo_gamma_beta_ratio", "reference")  # fmt: skip
# What the value of a sampler setting sized by `largest_fitting` (`auto`) counts, as its log line says it.
AUTO_UNITS = {"max_tokens": "tokens per pack", "batch_size": "examples per batch"}


class PackedCausalLM(LightningModule):
    """Fine-tune a transformers causal LM on packed batches with an exact varlen attention backend.

    Args:
        name_or_path: `smollm2` (the packaged SmolLM2-135M-Instruct), a local folder or a Hub name; it also
            chooses the tokenizer (`data.tokenizer` is linked to it). `self.model` is the loaded `nn.Module`.
        model_config: random init from these config kwargs (with `model_type`) instead of loading `model`.
        vocab_size: the tokenizer's size (linked from the data module); see `load_causal_lm`.
        dtype: parameter dtype; leave unset (float32) with `precision=bf16-mixed`.
        attn_backend: auto | flash_attn | torch_varlen | per_example | sdpa_mask (see `backends.py`).
        varlen_impl: the FlashAttention implementation `torch_varlen` runs: `auto` (FA3 / FA4 where PyTorch
            >= 2.12 finds their package and the GPU takes it, else FA2), `FA2` (built into PyTorch), `FA3`, `FA4`.
        mixers: auto | kernel | per_example: how non-attention token mixers (state-space scans, delta rules,
            convolutions) keep packed examples apart: their packed kernels where installed and exact in the
            construction probe on the run's device, else per example (`auto`); see `mixers.py`.
        loss_normalization: `token`: one mean over all label tokens of the optimizer step (all micro-batches,
            all ranks); `sequence`: the mean over examples of each example's token mean (LongAlign).
        isolation_check: run the packed-vs-per-example self-test on the first packed training batch.
        loss_impl: `chunked` (default): LM head + cross-entropy on `loss_chunk_size` label tokens at a time, never
            the (T, V) logits, exact; `full`: the model's full logits (the plain transformers way); `liger`:
            Liger-Kernel's fused linear cross-entropy (CUDA, `pip install lit_packing[liger]`, token loss only).
        loss_chunk_size: label tokens per chunk of `chunked` (memory: ~16 bytes x chunk x vocabulary).
        memory_check: before the first step, predict the largest step's peak memory (logged as
            `train/predicted_peak_memory_gb`) and stop when it exceeds the limit (see `memory.py`).
        memory_limit_gb: the memory, in GiB, the whole process may hold at a step's peak: `memory_check` stops a
            step predicted over it and `max_tokens: auto` sizes steps under it. None: the device's memory (what the
            process holds + what the device can still give it); a number lowers that (room for other processes,
            or a smaller device's budget), never raises it.
        memory_margin: the fraction of the limit `max_tokens: auto` (and `batch_size: auto`) keeps free: the chosen
            step's predicted peak is at most `memory_limit_gb` x (1 - margin). 0.25 covers the largest
            under-prediction measured (a whole run peaking at 1.32x its prediction: docs/memory_and_compile.md).
        lr: peak learning rate (AdamW).
        weight_decay: AdamW weight decay, not applied to biases, norms and embeddings.
        betas: AdamW betas.
        eps: AdamW epsilon.
        warmup_steps: linear warmup from 0, in optimizer steps.
        scheduler: decay after warmup down to `min_lr_ratio * lr` at the last step, or constant.
        min_lr_ratio: final learning rate as a fraction of `lr`.
        gradient_checkpointing: recompute activations in the backward pass (less memory, ~30% more compute).
        compile: `torch.compile` the transformers decoder (automatic dynamic shapes: a new T recompiles once, then
            T is symbolic); `train/recompiles` counts the graphs compiled after the first step.
        lora: `peft.LoraConfig` kwargs (e.g. `{r: 16, lora_alpha: 32, target_modules: all-linear}`): train adapters.
        resize_embeddings: let a tokenizer larger than a pretrained model's vocabulary grow the embeddings.
        export_dir: at the end of `fit`, `save_pretrained` the model (adapters with LoRA) and tokenizer here.
        objective: `sft` (default): next-token cross-entropy; `dpo`, `ipo`, `simpo`, `orpo`: a preference objective
            on packed pairs (data.collator PairCollator, configs/dpo.yaml; see `preference.py`), the loss the mean
            over every pair of the optimizer step (`loss_normalization` does not apply).
        beta: the preference objective's beta (dpo / ipo / simpo: the reward's scale; orpo: the odds-ratio weight).
        simpo_gamma_beta_ratio: SimPO's target margin, as a fraction of beta.
        reference: where dpo / ipo take the reference log-probs from: `precomputed` (default: one no-grad pass of
            the initial model over every training and validation pair before the first step, cached beside the
            tokenized data and kept in checkpoints; no second model; needs a `PackingDataModule`'s cached pairs;
            see `reference.py`), `copy` (a frozen copy of the initial model, no gradient, not saved in
            checkpoints: twice the model's memory) or `lora` (the model with its adapter disabled: needs `lora`).
        nonfinite: a NaN/inf loss or gradient: `error` (default) stops the run naming the step; `skip` drops that
            optimizer step (no update) and counts it (`train/nonfinite_steps`, the fit summary).
    """

    def __init__(
        self,
        name_or_path: str = "smollm2",
        model_config: dict | None = None,
        vocab_size: int | None = None,
        dtype: DType | None = None,
        attn_backend: AttnBackend = "auto",
        varlen_impl: VarlenImpl = "auto",
        mixers: MixerChoice = "auto",
        loss_normalization: LossNormalization = "token",
        isolation_check: bool = True,
        loss_impl: LossImpl = "chunked",
        loss_chunk_size: int = 1024,
        memory_check: bool = True,
        memory_limit_gb: float | None = None,
        memory_margin: float = 0.25,
        lr: float = 2e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 0,
        scheduler: Schedule = "cosine",
        min_lr_ratio: float = 0.0,
        gradient_checkpointing: bool = False,
        compile: bool = False,
        lora: dict | None = None,
        resize_embeddings: bool = False,
        export_dir: str | None = None,
        nonfinite: NonFinite = "error",
        objective: Literal["sft", "dpo", "ipo", "simpo", "orpo"] = "sft",
        beta: float = 0.1,
        simpo_gamma_beta_ratio: float = 0.5,
        reference: Literal["precomputed", "copy", "lora"] = "precomputed",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        _check_settings(self.hparams)
        with _named_model_settings():
            check_loss_settings(loss_impl, loss_chunk_size, loss_normalization)
        # Under a sharded strategy (the CLI's `deferred_weights`, or Lightning's `init_module(empty_init=True)`) the
        # model is a skeleton on the meta device, filled once sharded (`configure_model`); this module's own state
        # (metrics) is real either way.
        self._deferred = deferring()
        with torch.device("cpu") if self._deferred else contextlib.nullcontext():
            self._build(lora)

    def _build(self, lora: dict | None) -> None:
        hp = self.hparams
        # Built on the host and checked for the device this machine trains on (a GPU backend on a machine without
        # one fails here); `setup` resolves once more for the trainer's device (`Packing.to_device`).
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with _named_model_settings():
            self.model, self.packing = build_model(
                hp.name_or_path, hp.model_config, hp.vocab_size, hp.dtype, hp.attn_backend, device, hp.mixers,
                hp.isolation_check, hp.resize_embeddings, hp.gradient_checkpointing, lora,
                check_head=hp.loss_impl != "full", deferred=self._deferred,
            )  # fmt: skip
            self.preference = preference_settings(hp.objective, hp.beta, hp.simpo_gamma_beta_ratio, hp.reference, lora)
        if self._deferred and not lora_init_supported(lora):
            raise ConfigError(LORA_SETTING, f"init_lora_weights={lora['init_lora_weights']!r} is not made on the "
                              "meta-device build of a sharded strategy (only peft's default)",
                              "leave init_lora_weights unset, or train with trainer.strategy=ddp")  # fmt: skip
        if not self._deferred and (hp.model_config is not None or (lora and lora_init_supported(lora))):
            # A random init the sharded build gives too, on any number of ranks (`materialize.initialize`).
            initialize(self.model, torch.initial_seed(), only=None if hp.model_config is not None else _adapter)
        # dpo / ipo with reference=copy: the initial model, frozen; held outside the module tree (not trained, not
        # saved in checkpoints), placed on the trainer's device at fit start (sharded like the policy when it is).
        self._reference: list[torch.nn.Module] = []
        if self.preference is not None and self.preference.needs_reference and hp.reference == "copy":
            self._reference.append(copy.deepcopy(self.model).eval().requires_grad_(False))
            if not self._deferred:
                pack_model(self._reference[0], "per_example")  # a copy is a new model: through the door, on the host
        # reference=precomputed: the initial weights' identity (before any checkpoint loads others) keys the tables,
        # computed or read at fit start, kept by the split's data fingerprint (host) and by stage (on the device).
        self._precomputed = bool(self.preference and self.preference.needs_reference and hp.reference == "precomputed")
        self._initial_weights = weights_fingerprint(self.model) if self._precomputed and not self._deferred else None
        self._reference_tables: dict[str, ReferenceTable] = {}
        self._stage_tables: dict[str, tuple[ReferenceTable, str]] = {}  # stage -> (table on the device, its name)
        self._loaded_weights = False  # a checkpoint's weights loaded: the policy is no longer the initial model
        self._metric_names: list[str] = []  # the preference metrics summed in `_step_totals` after loss and count
        self.eval_metrics = torch.nn.ModuleDict({stage: _eval_metrics() for stage in ("val", "test")})
        self._step_totals: torch.Tensor | None = None  # [token loss sum, label tokens] of this step on this rank
        self._isolation_pending = hp.isolation_check
        self.nonfinite_steps = 0  # optimizer steps skipped under nonfinite=skip
        self._step_rows: list[int] = []  # source rows of the examples in the optimizer step under way (host-side)
        self._graphs_after_first_step: int | None = None  # torch.compile graphs compiled by the end of step 1
        self.memory_estimate = None  # set at train start (`memory_check`)
        self._data: DataContract | None = None  # what the data publishes (`connect_data`)

    # ------------------------------------------------------------------------------------------------------------
    # Setup

    @property
    def attn_backend(self) -> str:
        """The attention backend the model runs now (`auto` resolved)."""
        return self.packing.backend

    @property
    def hf_model(self):
        """The underlying transformers model (unwrapping peft)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    @property
    def shard_count(self) -> int:
        """Over how many ranks the parameters, gradients and optimizer state are split (1 unless FSDP2 shards)."""
        return shard_count(getattr(self, "_device_mesh", None)) if is_sharded(self.model) else 1

    @property
    def contract(self) -> ModelContract:
        """What the data may know of this model: its shape, hence its cost coefficients (an example of L tokens
        costs `a * L + b * L^2` FLOPs, with which `MultipackSampler` balances ranks), and `largest_fitting`, with
        which a sampler's `auto` setting is sized."""
        return ModelContract(shape=model_shape(self.model), largest_fitting=self.largest_fitting)

    def connect_data(self, data: DataContract) -> None:
        """What the data publishes: the token-id range checked at setup, the rows that name a failed step's
        examples, the largest step the memory estimate sizes, the tokenizer `export` saves beside the weights."""
        self._data = data

    def configure_callbacks(self) -> list[Callback]:
        """The data/model connection, on every `Trainer` this module runs in (the CLI's or a plain one)."""
        return [DataModelConnection()]

    def setup(self, stage: str) -> None:
        strategy = type(self.trainer.strategy).__name__
        if stage == "fit" and strategy not in TESTED_STRATEGIES:
            raise ConfigError(
                "trainer.strategy",
                f"{strategy} is not supported: the loss normalisation is tested under {', '.join(TESTED_STRATEGIES)}",
                "use auto, ddp, ModelParallelStrategy (FSDP2) or fsdp (FSDP1, CUDA GPUs only)",
            )
        device = self.trainer.strategy.root_device
        if self.packing is not None:  # a deferred model is packed once it holds its values (`configure_model`)
            self._place_backend(device)
        self._check_token_ids()
        if not getattr(self, "_described", False):  # once per process: what Lightning's model summary would say
            log.info(describe_model(self.model))
            self._described = True
        if self.hparams.compile and not getattr(self, "_compiled", False):
            # The decoder, which both the loss (hidden states) and `forward` (logits) run through.
            self.hf_model.base_model.compile(dynamic=None)
            self._compiled = True

    def _place_backend(self, device: torch.device) -> None:
        """The attention backend resolved for the trainer's device and set, said in one line."""
        with _named_model_settings():
            self.packing.to_device(self.model, device)
        how = " (auto)" if self.hparams.attn_backend == "auto" else ""
        if self.attn_backend == "torch_varlen":
            with _named_model_settings():
                how += f", {select_varlen_impl(self.hparams.varlen_impl, device)}"
        log.info("attention backend: %s%s on %s", self.attn_backend, how, device)
        note = precision_note(self.attn_backend, _activation_dtype(self.hf_model, str(self.trainer.precision)))
        if note:
            log.warning(note)
        if self.hparams.loss_impl == "liger":
            check_liger(device, self.hf_model.get_output_embeddings())

    def configure_model(self) -> None:
        """Under `ModelParallelStrategy`: split attention heads and MLP columns over the strategy's tensor-parallel
        ranks when it has several, then shard every decoder layer, then the root, with FSDP2 over its data-parallel
        mesh (`sharding.shard_model`); a model built on the meta device (`materialize.deferred_weights`) is then
        filled, each rank its shards only, and packed. With any other strategy, a deferred model is filled whole on
        the trainer's device; otherwise nothing (Lightning wraps the model)."""
        mesh = getattr(self, "_device_mesh", None)  # set by ModelParallelStrategy only
        if is_sharded(self.model) or (mesh is None and not is_meta(self.model)):
            return
        if mesh is not None:
            tp = tensor_parallel_size(mesh)
            if tp > 1:
                tensor_parallel_plan(self.model, tp)  # refused before any collective
            if self.hparams.model_config is not None and not self._deferred:
                self._broadcast_initial_weights()
            for model in [self.model, *(self._reference if self._deferred else [])]:  # a whole-built copy stays whole
                plan = shard_model(model, mesh, str(self.trainer.precision))
            log.info(
                "FSDP2: %d %s layers and the root sharded over %d data-parallel ranks%s",
                len(plan.layers), plan.layer_class, data_parallel_mesh(mesh).size(),
                f", attention heads and MLP columns split over {tp} tensor-parallel ranks" if tp > 1 else "",
            )  # fmt: skip
        if is_meta(self.model):
            self._materialize()

    def _materialize(self) -> None:
        """Fill the deferred model (and a reference copy) where it trains, then pack it (`loading.finish_build`)."""
        with host_memory_returned():
            hp, strategy, start = self.hparams, self.trainer.strategy, time.perf_counter()
            device = strategy.root_device
            folder = None if hp.model_config is not None else local_folder(resolve_pretrained(hp.name_or_path))
            weights = Weights(hp.name_or_path, folder, strategy.broadcast(torch.initial_seed()))
            for model in [self.model, *self._reference]:
                materialize(model, device, weights)
            log.info("weights %s in %.1f s: %s on this rank", f"read from {folder}" if folder else "initialised",
                     time.perf_counter() - start, count(sum(local_tensor(p).numel() for p in self.model.parameters()),
                     "parameter"))  # fmt: skip
            with _named_model_settings():
                self.packing = finish_build(self.model, hp.attn_backend, device, hp.mixers, hp.isolation_check,
                                            check_head=hp.loss_impl != "full")  # fmt: skip
                for reference in self._reference:
                    finish_build(reference, "per_example", device, hp.mixers, check=False, check_head=False)
            for model in [self.model, *self._reference]:
                reshard(model)  # the probe's forwards left the root gathered
        self._place_backend(device)
        if self._precomputed:
            self._initial_weights = strategy.broadcast(weights_fingerprint(self.model))

    def _broadcast_initial_weights(self) -> None:
        """A random init is rank 0's on every rank (as DDP does at wrap), so that each rank's shard is of one model."""
        with torch.no_grad():
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                torch.distributed.broadcast(tensor.data, src=0)

    def _check_token_ids(self) -> None:
        """Refuse data whose token ids fall outside the embedding table (once, from the data's max id)."""
        low, high = self._data.token_id_range if self._data is not None else (0, 0)
        rows = self.hf_model.get_input_embeddings().num_embeddings
        if low < 0 or high >= rows:
            raise DataError(
                f"the tokenized data holds token ids {low:,}..{high:,} but the model has {rows:,} embedding rows: "
                f"data.tokenizer does not match model.name_or_path (use the model's own tokenizer, or "
                f"model.resize_embeddings=true), or the tokenized cache was altered (delete it under data.cache_dir)"
            )

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint of another model in one line, before Lightning loads its weights (a size mismatch
        would otherwise end in a traceback); a LoRA run's checkpoint lacks the frozen weights by design. The
        precomputed reference log-probs it carries are the initial model's: they are used, never computed again."""
        self._loaded_weights = True
        self._reference_tables.update(
            {data: ReferenceTable(**state) for data, state in checkpoint.get(CHECKPOINT_KEY, {}).items()}
        )
        trainer = self._trainer
        if trainer is not None and trainer.strategy.restore_checkpoint_after_setup:
            return  # FSDP loads (and removes) the weights itself, sharded: comparing would gather them on every rank
        if "state_dict" not in checkpoint:
            return
        strict = self.strict_loading and trainer is not None  # `load_from_checkpoint(strict=...)` decides there
        problem = weights_mismatch(checkpoint["state_dict"], self.state_dict(), strict)
        if problem:
            path = getattr(trainer, "ckpt_path", None) if trainer is not None else None
            raise AssetError(
                "--ckpt_path",
                f"{path or 'the checkpoint'} holds another model than this run builds: {problem}",
                "resume with the model settings it was trained with (model.name_or_path, model.model_config, "
                "model.lora), or start a new run without --ckpt_path",
            )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the precomputed reference log-probs (32 bytes a pair): a resume uses the initial model's."""
        if self._reference_tables:
            checkpoint[CHECKPOINT_KEY] = {data: table.state() for data, table in self._reference_tables.items()}

    def on_fit_start(self) -> None:
        self.packing.route_mixers(self.model)  # on the trainer's device now: the probe decides any kernel route
        dtype = next(self.model.parameters()).dtype  # the precision plugin's (64-true converts the policy)
        for reference in self._reference:  # a packed model like the policy, on its device
            if self._deferred:  # built, sharded and packed with the policy (`configure_model`)
                reference.to(dtype=dtype)
                continue
            pack_model(reference.to(device=self.device, dtype=dtype), self.attn_backend, self.device)
        self._reference_logps("train", "val")

    def on_validation_start(self) -> None:
        if self.trainer.state.fn != "fit":  # `main.py validate`: no fit start computed the tables
            self._reference_logps("val")

    def on_test_start(self) -> None:
        self._reference_logps("test")

    def _reference_logps(self, *stages: str) -> None:
        """reference=precomputed: each stage's table on the device, from this run's memory or a checkpoint, else
        the cache beside the tokenized data, else one no-grad pass of the model over the split's pairs (which
        must still be the initial model: a fit's start, before any step or checkpoint). Rank 0 decides what is
        read, and every rank computes its share of a pass, so the ranks' forwards stay matched."""
        if not self._precomputed:
            return
        pair_split = self._data.pair_split if self._data is not None else None
        for stage in stages:
            split = pair_split(stage) if pair_split is not None else None
            if split is None:
                if stage == "train":
                    raise ConfigError(
                        "model.reference",
                        "precomputed computes the reference log-probs from the training pairs of a "
                        "PackingDataModule's tokenized data (data.collator PairCollator, not streamed), and this "
                        "fit has none",
                        "train from a PackingDataModule with pairs, or set model.reference=copy",
                    )
                continue
            table, where = self._reference_table(split, stage)
            self._stage_tables[stage] = (table.to(self.device), where)

    def _reference_table(self, split: PairSplit, stage: str) -> tuple[ReferenceTable, str]:
        """One split's table and what names it in messages (read, or computed and cached)."""
        trainer = self.trainer
        key = trainer.strategy.broadcast(
            table_key(self.hparams.name_or_path, self._initial_weights, str(trainer.precision), split.fingerprint)
        )  # rank 0's: every rank reads or computes the same
        path = Path(split.folder) / f"{key}.pt" if split.folder is not None else None
        where = f"{stage} pairs, {path or 'not cached: the data is in memory'}"
        table = self._reference_tables.get(split.fingerprint)
        if table is not None:
            log.info("reference log-probs (%s): %d pairs, from this run (a checkpoint, or the fit before)", where,
                     len(table))  # fmt: skip
            return table, where
        found = read_table(path) if path is not None and trainer.is_global_zero else None
        table = trainer.strategy.broadcast(found)
        if table is not None:
            log.info("reference log-probs (%s): %d pairs, read from the cache", where, len(table))
        else:
            if self._loaded_weights or self.global_step > 0:
                raise ConfigError(
                    "model.reference",
                    f"precomputed: the reference log-probs of the {stage} pairs are neither in the checkpoint nor "
                    f"cached ({path}), and the model now holds trained weights, not the initial model's",
                    "run a fit from the initial model first (it caches them), or set model.reference=copy",
                )
            table = self._compute_table(split, stage)
            if path is not None and trainer.is_global_zero:
                write_table(table, path)
        self._reference_tables[split.fingerprint] = table
        return table, where

    def _compute_table(self, split: PairSplit, stage: str) -> ReferenceTable:
        """One no-grad pass of the (initial) model over this rank's share of the split's pairs, as the training
        step computes the policy's log-probs (the same head, precision context and packing); eval mode."""
        trainer, loader, start = self.trainer, split.loader(), time.perf_counter()
        log.info("reference log-probs (%s pairs): computing %s with the initial model, %s on this rank "
                 "(model.reference=precomputed; once: later fits read the cache)", stage, count(split.pairs, "pair"),
                 count(len(loader), "batch"))  # fmt: skip
        quiet = not trainer.is_global_zero or trainer.progress_bar_callback is None
        training, parts = self.model.training, []
        self.model.eval()
        try:
            with torch.no_grad(), self._forward_context():
                for batch in tqdm(loader, desc=f"reference log-probs ({stage})", disable=True if quiet else None):
                    batch = trainer.strategy.batch_to_device(batch)
                    parts.append((batch[ROWS], pair_logps(self.loss_outputs(batch), batch)))
        finally:
            self.model.train(training)
        table = ReferenceTable.of(parts).gathered(
            lambda t: trainer.strategy.all_gather(t.to(self.device)), trainer.world_size
        )
        log.info("reference log-probs (%s pairs): %d computed in %.1f s", stage, len(table),
                 time.perf_counter() - start)  # fmt: skip
        return table

    def on_train_start(self) -> None:
        if self.hparams.memory_check:
            self.memory_estimate = check_fit_memory(self, self._data.largest_step() if self._data else None)

    def largest_fitting(
        self,
        step_of: Callable[[int], StepShape],
        candidates: Sequence[int],
        what: str = "max_tokens",
        unit: str | None = None,
    ) -> tuple[int | None, MemoryEstimate]:
        """The largest step size whose predicted peak memory fits with `memory_margin` to spare: what
        `max_tokens: auto` / `batch_size: auto` ask the model (through `contract.largest_fitting`) when the
        training loader is built, with the model on its device and the trainer attached.

        The probes run once (3 forwards, `memory_model`); each candidate's estimate is then arithmetic. Logs one
        line (the choice, its predicted peak, the limit and margin, the next candidate's peak) and, on global rank
        zero, `train/auto_<what>` at step 0.

        Args:
            step_of: a candidate -> the worst-case `StepShape` of a step that size (the collator's padding rule
                applied to the longest example).
            candidates: increasing values to choose from.
            what: the setting being chosen, as the log line names it: `max_tokens`, `batch_size`.
            unit: what the value counts, as the log line says it; default `tokens per pack` for `max_tokens`,
                `examples per batch` for `batch_size`.

        Returns:
            (value, estimate): the largest candidate whose predicted peak is at most the limit (`memory_limit_gb`,
            else the device's memory) x (1 - `memory_margin`), None when none is; with several ranks, the smallest
            any rank chose. The estimate is that candidate's (the smallest candidate's when none fits).
        """
        candidates = increasing(candidates)
        trainer = self.trainer
        memory = memory_model(self, str(trainer.precision), padded=step_of(candidates[0]).padded)
        choice = choose_largest_fitting(
            memory, step_of, candidates, self.hparams.memory_margin, agree=self._smallest_over_ranks
        )
        unit = unit or AUTO_UNITS.get(what, "")
        if choice.value is None:
            log.warning(choice.describe(what, unit))
            return None, choice.estimate
        log.info(choice.describe(what, unit))
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({f"train/auto_{what}": float(choice.value)}, step=0)
        return choice.value, choice.estimate

    def _smallest_over_ranks(self, index: int) -> int:
        """The smallest of every rank's `index` (one all-gather with several ranks): what each process holds and
        can take differs a little, but every rank must build the same plan."""
        if self.trainer.world_size == 1:
            return index
        return int(self.trainer.strategy.all_gather(torch.tensor(index, device=self.device)).min())

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.hparams.compile:  # graphs compiled after the first step: shape changes that cost a recompile
            graphs = compiled_graphs()
            if self._graphs_after_first_step is None:
                self._graphs_after_first_step = graphs
            self.log("train/recompiles", float(graphs - self._graphs_after_first_step), on_step=True, on_epoch=False)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, Mapping):
            check_packed_batch(batch)
        return batch

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_rows.extend(batch.get(ROWS, ()))
        sync_gradients(self.model, last=not accumulates(self.trainer))  # FSDP2: reduce-scatter on the last only
        # Every rank runs it on its first packed batch, an empty pack included: the same number of forwards on
        # every rank (see `sample_packed`), so a sharded model's collectives stay matched and nothing hangs.
        if self._isolation_pending and is_packed(batch):
            with self._forward_context(), _named_model_settings():
                diff = check_isolation(self.model, batch, self.attn_backend)
            log.info("isolation self-test passed: attn_backend=%s, max abs logit diff %.3g", self.attn_backend, diff)
            self._isolation_pending = False

    def _forward_context(self):
        trainer = attached_trainer(self)
        return trainer.precision_plugin.forward_context() if trainer is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------------------------------------------------
    # Steps

    def forward(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """Logits (B, T, V) of a packed or padded batch. Never uses a KV cache: a cache disables isolation."""
        return self.model(**model_inputs(batch), use_cache=False).logits

    def head_inputs(self, batch: Mapping[str, Any]) -> HeadInputs:
        """The final hidden states of a batch with the LM head, for a loss that never builds the (T, V) logits."""
        impl = "liger" if self.hparams.loss_impl == "liger" else "chunked"
        return head_inputs(self.model, batch, self.hparams.loss_chunk_size, impl)

    def loss_outputs(self, batch: Mapping[str, Any]) -> torch.Tensor | HeadInputs:
        """What the loss reads: full logits (`loss_impl=full`) or `HeadInputs`."""
        return self(batch) if self.hparams.loss_impl == "full" else self.head_inputs(batch)

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor:
        parts, metrics = self._loss_parts(batch)
        normalizer = self._step_normalizer(batch, parts)
        self._metric_names = list(metrics)
        local = torch.stack([parts.token_loss_sum.detach(), parts.label_tokens.detach(), *metrics.values()])
        local = local.to(_accumulator_dtype(local.device))
        self._step_totals = local if self._step_totals is None else self._step_totals + local
        # Lightning divides by accumulate_grad_batches and DDP averages over ranks: undo both, so the step's
        # gradient is sum(objective) / normalizer over every micro-batch on every rank. FSDP2 sums (shard_model).
        ranks = 1 if type(self.trainer.strategy).__name__ in SUMMING_STRATEGIES else self.trainer.world_size
        factor = ranks * self.trainer.accumulate_grad_batches
        return parts.objective * (factor / normalizer)

    def _loss_parts(self, batch: Mapping[str, Any]) -> tuple[LossParts, dict[str, torch.Tensor]]:
        """This micro-batch's loss sums and, for a preference objective, its metrics' sums over its pairs (a pair
        counts as one: `label_tokens` is the number of pairs)."""
        if self.preference is None:
            return causal_lm_loss(self.loss_outputs(batch), batch, self.hparams.loss_normalization), {}
        parts = self._preference_parts(batch, "train")
        pairs = torch.tensor(float(len(parts.chosen_rewards)), device=parts.loss_sum.device)
        return LossParts(parts.loss_sum, pairs, parts.loss_sum, pairs), preference_metrics(parts)

    def _preference_parts(self, batch: Mapping[str, Any], stage: str) -> PreferenceParts:
        policy = pair_logps(self.loss_outputs(batch), batch)
        reference = None
        if self._precomputed:
            if stage not in self._stage_tables:
                raise ConfigError(
                    "model.reference",
                    f"precomputed: no reference log-probs for the {stage} pairs (they are computed at fit start, "
                    "from a PackingDataModule's pairs)",
                    "fit with a PackingDataModule, or set model.reference=copy",
                )
            table, where = self._stage_tables[stage]
            reference = table.lookup(batch.get(ROWS, []), policy, where)
        elif self.preference.needs_reference:
            with torch.no_grad():
                if self._reference:
                    impl = "liger" if self.hparams.loss_impl == "liger" else "chunked"
                    outputs = head_inputs(self._reference[0], batch, self.hparams.loss_chunk_size, impl)
                    reference = pair_logps(outputs, batch)
                else:  # reference=lora: the base model, its adapter off
                    with self.model.disable_adapter():
                        reference = pair_logps(self.loss_outputs(batch), batch)
        return preference_loss(policy, reference, self.preference)

    def _step_normalizer(self, batch: Mapping[str, Any], parts) -> int | torch.Tensor:
        """The optimizer step's global label tokens (or sequences, or pairs): from the batch, else this
        micro-batch's."""
        key = "label_tokens" if self.hparams.loss_normalization == "token" and self.preference is None else "sequences"
        if STEP in batch:
            return max(batch[STEP][key], 1)
        if self.trainer.world_size * self.trainer.accumulate_grad_batches > 1:
            raise DataError(
                f"the batch has no '{STEP}' totals, so with world_size={self.trainer.world_size} and "
                f"accumulate_grad_batches={self.trainer.accumulate_grad_batches} its loss cannot be normalised over "
                "the optimizer step: use PackingDataModule's samplers, or give every micro-batch of a step "
                "lit_packing.batch.attach_step(...)"
            )
        return parts.normalizer.detach().clamp_min(1)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Log `train/loss`, the step's per-token mean over all ranks: summed locally, reduced at logging steps only
        (one all-reduce every `trainer.log_every_n_steps`, none in between)."""
        totals, self._step_totals = self._step_totals, None
        trainer = self.trainer
        if totals is None:
            return
        if not self._finite_step(totals[0]):
            return
        if trainer.world_size > 1 and (trainer.global_step + 1) % trainer.log_every_n_steps and trainer.global_step:
            return
        totals = trainer.strategy.reduce(totals, reduce_op="sum")
        self.log("train/loss", totals[0] / totals[1].clamp_min(1), prog_bar=True, on_step=True, on_epoch=False)
        for name, total in zip(self._metric_names, totals[2:]):  # preference metrics: means over the step's pairs
            self.log(f"train/{name}", total / totals[1].clamp_min(1), on_step=True, on_epoch=False)

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Sharded, clip by the norm of the whole gradient (`sharding.clip_grad_norm`: torch's own cannot combine
        the norms of tensor-parallel and replicated DTensor gradients); otherwise as Lightning does."""
        if is_sharded(self.model) and gradient_clip_val and gradient_clip_algorithm in (None, "norm"):
            clip_grad_norm(self.parameters(), gradient_clip_val)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def _finite_step(self, loss_sum: torch.Tensor) -> bool:
        """Whether this optimizer step's loss and gradients are finite (one host sync); if not, raise a
        `TrainingError` (`nonfinite=error`) or drop every gradient so the optimizer skips the step (`skip`)."""
        rows, self._step_rows = self._step_rows, []
        grads = [local_tensor(p.grad) for p in self.parameters() if p.grad is not None]  # a shard each, sharded
        # Under fp16 the GradScaler itself skips steps with inf gradients (and lowers its scale): check the loss only.
        check_grads = grads and str(self.trainer.precision) != "16-mixed"
        norms = foreach_norm(grads) if check_grads else []
        local = torch.stack([loss_sum.float(), *(n.float().to(loss_sum.device) for n in norms)]).sum()
        # One scalar all-reduce with several ranks, so that every rank takes the same decision (NaN + x = NaN).
        total = self.trainer.strategy.reduce(local, reduce_op="sum") if self.trainer.world_size > 1 else local
        if torch.isfinite(total):
            return True
        what = "gradient" if torch.isfinite(loss_sum) else "loss"
        if self.hparams.nonfinite == "error":
            raise TrainingError(
                f"non-finite {what} at optimizer step {self.global_step + 1} (epoch {self.current_epoch}; examples "
                f"of that step: {self._name_rows(rows[:SAMPLE_ROWS])}): lower model.lr (now {self.hparams.lr:g}), set "
                f"trainer.gradient_clip_val, check those examples, or set model.nonfinite=skip to skip such steps "
                f"(they are counted)"
            )
        for p in self.parameters():
            p.grad = None  # AdamW leaves parameters without a gradient untouched
        self.nonfinite_steps += 1
        log.warning("skipped optimizer step %d: non-finite %s (model.nonfinite=skip)", self.global_step, what)
        self.log("train/nonfinite_steps", float(self.nonfinite_steps), on_step=True, on_epoch=False)
        return False

    def _name_rows(self, rows: list[int]) -> str:
        """The examples' rows as the user counts them (the data knows the source), else their indices."""
        if self._data is not None:
            return self._data.name_rows(rows)
        return f"rows {', '.join(map(str, rows))}" if rows else "not recorded"

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def _eval_step(self, batch: Mapping[str, Any], stage: str) -> None:
        if self.preference is not None:  # the objective's mean over pairs, and how often chosen out-rewards rejected
            parts = self._preference_parts(batch, stage)
            loss_sum, tokens = parts.loss_sum, torch.tensor(len(parts.chosen_rewards), device=parts.loss_sum.device)
            correct = (parts.chosen_rewards > parts.rejected_rewards).sum()
        else:
            loss_sum, tokens, correct = eval_sums(self.loss_outputs(batch), batch[LABELS])
        metrics = self.eval_metrics[stage]
        metrics["loss_sum"].update(loss_sum)
        metrics["tokens"].update(tokens)
        metrics["correct"].update(correct)

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val")

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")

    def _log_eval(self, stage: str) -> None:
        metrics = self.eval_metrics[stage]
        tokens = metrics["tokens"].compute().clamp_min(1)  # torchmetrics sums over steps and ranks
        loss = metrics["loss_sum"].compute() / tokens
        accuracy = metrics["correct"].compute() / tokens
        for metric in metrics.values():
            metric.reset()
        self.log(f"{stage}/loss", loss, prog_bar=True)
        if self.preference is not None:
            self.log(f"{stage}/reward_accuracy", accuracy)
            return
        self.log(f"{stage}/perplexity", loss.exp())
        self.log(f"{stage}/token_accuracy", accuracy)

    # ------------------------------------------------------------------------------------------------------------
    # Optimizer, export

    def configure_optimizers(self):
        hp = self.hparams
        # Fused AdamW unscales inside step(): Lightning's mixed-precision plugin (bf16-mixed and 16-mixed) refuses
        # to clip gradients for such an optimizer, so a clipped mixed-precision run takes the foreach kernel.
        mixed = str(self.trainer.precision).endswith("-mixed")
        fused = self.device.type == "cuda" and not (mixed and (self.trainer.gradient_clip_val or 0) > 0)
        optimizer = torch.optim.AdamW(
            parameter_groups(self.model, hp.weight_decay),
            lr=hp.lr,
            betas=tuple(hp.betas),
            eps=hp.eps,
            fused=fused or None,
        )
        trainer = self.trainer
        if trainer.strategy.restore_checkpoint_after_setup:
            # A strategy that restores a checkpoint after `configure_optimizers` (ModelParallelStrategy): counting
            # the steps now would start the training loader before a resume gives the data module its position.
            first = self._schedule(self.hparams.warmup_steps + 1)(0)  # step 0's multiplier, whatever the count
            schedule = _counted_at_first_step(lambda: self._schedule(trainer.estimated_stepping_batches), first)
        else:
            schedule = self._schedule(trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _schedule(self, total: float) -> Callable[[int], float]:
        hp, kind = self.hparams, self.hparams.scheduler
        if not math.isfinite(total) and kind != "constant":
            log.warning("the number of steps is unknown: scheduler=%s becomes constant; set trainer.max_steps", kind)
            total, kind = 0, "constant"
        return lr_schedule(kind, hp.warmup_steps, max(1, int(total)), hp.min_lr_ratio)

    def on_fit_end(self) -> None:
        if self.hparams.export_dir:
            self.export(self.hparams.export_dir)

    def export(self, path: str) -> None:
        """Write the model as a Hugging Face folder (LoRA: the adapters) and, when one is known, the tokenizer.
        Sharded, a collective every rank calls, which writes the folder file by file without gathering the whole
        model anywhere (`export.export_sharded`).

        Raises:
            TrainingError: a weight is NaN or infinite; nothing is written.
        """
        tokenizer = self._data.tokenizer if self._data is not None else None
        if tokenizer is None and self.hparams.model_config is None:
            with contextlib.suppress(Exception):  # a tokenizer is a nicety here: the weights are what matters
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained(self.hparams.name_or_path, False))
        if is_sharded(self.model):
            export_sharded(self.model, path, tokenizer)
        elif (trainer := attached_trainer(self)) is None or trainer.is_global_zero:
            export_model(self.model, path, tokenizer)


def _adapter(name: str) -> bool:
    return ".lora_" in name


def _check_settings(hp: Mapping[str, Any]) -> None:
    """Range-check the numeric settings and choices, naming each by its CLI path (`model.lr`)."""
    if hp["nonfinite"] not in ("error", "skip"):
        raise ConfigError("model.nonfinite", f"{hp['nonfinite']!r} is not a policy", "use error or skip")
    check_range("model.lr", hp["lr"], 0)  # 0 is a dry run: gradients without updates
    check_range("model.weight_decay", hp["weight_decay"], 0)
    check_range("model.eps", hp["eps"], 0, low_open=True)
    check_range("model.warmup_steps", hp["warmup_steps"], 0)
    check_range("model.min_lr_ratio", hp["min_lr_ratio"], 0, 1)
    check_range("model.vocab_size", hp["vocab_size"], 1)
    check_range("model.memory_limit_gb", hp["memory_limit_gb"], 0, low_open=True)
    check_range("model.memory_margin", hp["memory_margin"], 0, 1, high_open=True)
    for i, beta in enumerate(hp["betas"]):
        check_range(f"model.betas[{i}]", beta, 0, 1, high_open=True)


@contextlib.contextmanager
def _named_model_settings():
    """A core `ConfigError` (e.g. a backend that cannot run this model) named by its `model.*` path."""
    try:
        yield
    except ConfigError as error:
        raise error.under({name: f"model.{name}" for name in MODEL_SETTINGS}) from None


def _activation_dtype(model: torch.nn.Module, precision: str) -> torch.dtype:
    """The dtype attention sees: the autocast dtype of a mixed precision, else the parameters'."""
    if precision.startswith("bf16-mixed"):
        return torch.bfloat16
    if precision.startswith("16-mixed"):
        return torch.float16
    return next(model.parameters()).dtype


def _eval_metrics() -> torch.nn.ModuleDict:
    # Sums (not means) aggregate exactly over steps and ranks; nan_strategy="disable" avoids a device sync.
    return torch.nn.ModuleDict(
        {name: torchmetrics.SumMetric(nan_strategy="disable") for name in ("loss_sum", "tokens", "correct")}
    )


def _counted_at_first_step(build: Callable[[], Callable[[int], float]], first: float) -> Callable[[int], float]:
    """A schedule built when it is first asked for a step after 0 (`build`); at step 0, `first`: every schedule's
    multiplier there is the same whatever the step count (warmup's first step, or the start of the decay). A plain
    function, so that `LambdaLR.state_dict` does not try to save it."""
    built: list[Callable[[int], float]] = []

    def multiplier(step: int) -> float:
        if step == 0 and not built:
            return first
        if not built:
            built.append(build())
        return built[0](step)

    return multiplier


def _accumulator_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64
