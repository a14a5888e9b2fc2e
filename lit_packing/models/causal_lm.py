"""`PackedCausalLM`: a LightningModule that fine-tunes a transformers causal LM on packed (or padded) batches.

    lm = PackedCausalLM(name_or_path="smollm2", attn_backend="auto", lr=2e-5)
    Trainer(precision="bf16-mixed", accumulate_grad_batches=4).fit(lm, datamodule=dm)

Lightning's hooks over the parts, each in its module: the model's build (`loading`: whole, or under a sharded
strategy on the meta device, then split and filled shard by shard: `materialize`), made packed (`pack`); the loss
from the last hidden states chunk by chunk, one global mean over the optimizer step's micro-batches and ranks, so
that packing never changes the gradient (`loss`); the memory estimate and `max_tokens: auto` (`memory`); the
batch guard (`guard`) and isolation self-test (`selftest`); the numerics guard (`numerics`); the objective, one
seam (`objectives`: sft, the preference objectives, GRPO's family) and its reference (`reference`); AdamW and its
schedule (`optim`); the export (`export`).
Validation logs `val/loss`, `val/perplexity` and `val/token_accuracy`, on which packed and padded batches agree.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule

from lit_packing._compat import attached_trainer, compiled_graphs
from lit_packing.batch import ROWS, StepShape, is_packed, model_inputs
from lit_packing.contract import DataContract, DataModelConnection, ModelContract, Policy
from lit_packing.cost import model_shape
from lit_packing.models.auto_size import largest_fitting
from lit_packing.models.backends import AttnBackend, VarlenImpl, activation_dtype
from lit_packing.models.context import ContextGroup, check_dealable, context_group, deal
from lit_packing.models.export import export_lm
from lit_packing.models.guard import check_packed_batch
from lit_packing.models.head import head_inputs
from lit_packing.models.loading import (
    DType,
    build_models,
    check_model_settings,
    fill_models,
    named_model_settings,
    shard_models,
)
from lit_packing.models.loss import (
    EvalTotals,
    HeadInputs,
    LossImpl,
    LossNormalization,
    check_loss_settings,
    check_strategy,
    gradient_factor,
    step_normalizer,
)
from lit_packing.models.materialize import deferring, is_meta
from lit_packing.models.memory import MemoryEstimate, check_fit_memory
from lit_packing.models.mixers import MixerChoice
from lit_packing.models.numerics import finite_step
from lit_packing.models.objectives import ModelHandle, Objective, make_objective
from lit_packing.models.optim import adamw_and_schedule
from lit_packing.models.pack import pack_model
from lit_packing.models.quantize import QuantizationKind, check_quantized_strategy
from lit_packing.models.reference import CHECKPOINT_KEY, PrecomputedReference, reference_forward, weights_fingerprint
from lit_packing.models.selftest import check_isolation
from lit_packing.models.sharding import clip_grad_norm, is_sharded, shard_count, sync_gradients
from lit_packing.models.weights import check_checkpoint_weights, check_token_ids, describe_model

log = logging.getLogger(__name__)

Schedule = Literal["cosine", "linear", "constant"]
NonFinite = Literal["error", "skip"]


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
            Liger-Kernel's fused linear cross-entropy (CUDA, the `liger` extra, token loss only).
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
        optimizer: `adamw` (torch's), or `adamw8bit` (bitsandbytes': the two moments in 8 bits, ~2 bytes a
            parameter instead of 8; one device or DDP).
        lora: `peft.LoraConfig` kwargs (e.g. `{r: 16, lora_alpha: 32, target_modules: all-linear}`): train adapters.
        quantization: QLoRA: the pretrained base's linear layers quantized as they load (`nf4`, `fp4`: 4 bits a
            weight; `int8`), adapters (`lora`, required) trained on top (`quantize.py`; needs bitsandbytes).
        quantization_dtype: the dtype a 4-bit layer computes in (its weights dequantized to it for each matmul);
            `auto`: the trainer's precision's (bf16 under bf16-mixed; the CLI resolves it), else float32.
        double_quantization: quantize the 4-bit layers' scales too (~0.4 bits a weight fewer).
        resize_embeddings: let a tokenizer larger than a pretrained model's vocabulary grow the embeddings.
        export_dir: at the end of `fit`, `save_pretrained` the model and tokenizer here; a LoRA (or QLoRA) model
            with its adapters merged into the (dequantized) base weights: a plain model for `from_pretrained`.
        export_adapters_only: with LoRA, export the adapters alone (peft's folder) instead of the merged model.
        objective: `sft` (default): next-token cross-entropy; `dpo`, `ipo`, `simpo`, `orpo`: a preference objective
            on packed pairs (data.collator PairCollator, configs/dpo.yaml; see `preference.py`), the loss the mean
            over every pair of the optimizer step (`loss_normalization` does not apply); or an `Objective` by
            `class_path` with its own settings (`lit_packing.models.GRPO`: policy gradient on rollout groups).
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
        optimizer: Literal["adamw", "adamw8bit"] = "adamw",
        lora: dict | None = None,
        quantization: QuantizationKind | None = None,
        quantization_dtype: DType | Literal["auto"] = "auto",
        double_quantization: bool = True,
        resize_embeddings: bool = False,
        export_dir: str | None = None,
        export_adapters_only: bool = False,
        nonfinite: NonFinite = "error",
        objective: Literal["sft", "dpo", "ipo", "simpo", "orpo"] | Objective = "sft",
        beta: float = 0.1,
        simpo_gamma_beta_ratio: float = 0.5,
        reference: Literal["precomputed", "copy", "lora"] = "precomputed",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_model_settings(self.hparams)
        with named_model_settings():
            check_loss_settings(loss_impl, loss_chunk_size, loss_normalization)
        # Under a sharded strategy (`materialize.deferred_weights`, `init_module(empty_init=True)`) the model is built
        # on the meta device, filled once sharded (`configure_model`) from the seed it is built under.
        self._deferred, self._init_seed = deferring(), torch.initial_seed()
        with torch.device("cpu") if self._deferred else contextlib.nullcontext():
            with named_model_settings():
                self.objective = make_objective(objective, self.hparams)
            needs = self.objective.needs_reference
            # reference=copy: the initial model, frozen, held outside the module tree (not trained, not saved in
            # checkpoints), placed on the trainer's device at fit start (sharded like the policy when it is).
            self.model, self.packing, self.frozen_copies = build_models(self.hparams, self._deferred,
                                                                      needs and reference == "copy")  # fmt: skip
            # reference=precomputed: tables computed or read at fit start, keyed by the initial weights' identity.
            precomputed = needs and reference == "precomputed"
            self.precomputed = PrecomputedReference(name_or_path, self.objective.temperature) if precomputed else None
            if self.precomputed is not None and not self._deferred:  # a deferred model's once filled
                self.precomputed.initial_weights = weights_fingerprint(self.model)
            self._init_state()

    def _init_state(self) -> None:
        hp = self.hparams
        self._metric_names: list[str] = []  # the objective's metrics summed in `_step_totals` after loss and count
        self.eval_totals = EvalTotals(("val", "test"))
        self._step_totals: torch.Tensor | None = None  # [token loss sum, label tokens] of this step on this rank
        self._isolation_pending = hp.isolation_check
        self.nonfinite_steps = 0  # optimizer steps skipped under nonfinite=skip
        self._step_rows: list[int] = []  # source rows of the examples in the optimizer step under way (host-side)
        self._graphs_after_first_step: int | None = None  # torch.compile graphs compiled by the end of step 1
        self.memory_estimate = None  # set at train start (`memory_check`)
        self.context: ContextGroup | None = None  # the context-parallel group this rank trains its packs with
        self._data: DataContract | None = None  # what the data publishes (`connect_data`)

    # Setup: the build's later steps, the data's contract, checkpoints
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
        policy = Policy(self.model, self.objective.temperature, self.objective.round_advantages)
        return ModelContract(shape=model_shape(self.model), largest_fitting=self.largest_fitting, policy=policy)

    def connect_data(self, data: DataContract) -> None:
        """What the data publishes: the token-id range checked at setup, the rows that name a failed step's
        examples, the largest step the memory estimate sizes, the tokenizer `export` saves beside the weights."""
        self._data = data

    def configure_callbacks(self) -> list[Callback]:
        """The data/model connection, on every `Trainer` this module runs in (the CLI's or a plain one)."""
        return [DataModelConnection()]

    def setup(self, stage: str) -> None:
        if stage == "fit":
            check_strategy(type(self.trainer.strategy).__name__)
            if self.hparams.quantization is not None:
                check_quantized_strategy(self.hparams.quantization, type(self.trainer.strategy).__name__)
        device = self.trainer.strategy.root_device
        if not is_meta(self.model):  # a deferred model is placed once it holds its values (`configure_model`)
            self._place_backend(device)
        check_token_ids(self._data.token_id_range if self._data is not None else (0, 0), self.hf_model)
        if not getattr(self, "_described", False):  # once per process: what Lightning's model summary would say
            log.info(describe_model(self.model))
            self._described = True
        if self.hparams.compile and not getattr(self, "_compiled", False):  # the decoder: the loss's and forward's
            # On a CPU, inductor's kernels are held to 256-bit vectors: torch 2.13 compiles some of these graphs into
            # 512-bit kernels that write past a buffer on AVX-512 CPUs (NaN logits, or "malloc(): corrupted top
            # size"); 256-bit ones are what an AVX2 CPU runs anyway. A GPU compiles with Triton, unaffected.
            options = {"cpp.simdlen": 256} if device.type == "cpu" else None
            self.hf_model.base_model.compile(dynamic=None, options=options)
            self._compiled = True

    def _place_backend(self, device: torch.device) -> None:
        """The attention backend resolved for the trainer's device and set (`Packing.place`)."""
        hp = self.hparams
        with named_model_settings():
            self.packing.place(self.model, device, hp.attn_backend == "auto", hp.varlen_impl,
                               activation_dtype(self.hf_model, str(self.trainer.precision)), hp.loss_impl)  # fmt: skip

    def configure_model(self) -> None:
        """Under `ModelParallelStrategy`: split attention heads and MLP columns over the strategy's tensor-parallel
        ranks when it has several, then shard every decoder layer, then the root, with FSDP2 over its data-parallel
        mesh (`sharding.shard_model`); a model built on the meta device (`materialize.deferred_weights`) is then
        filled, each rank its shards only, and packed. With any other strategy, a deferred model is filled whole on
        the trainer's device; otherwise nothing (Lightning wraps the model)."""
        mesh = getattr(self, "_device_mesh", None)  # set by ModelParallelStrategy only
        if is_sharded(self.model) or (mesh is None and not is_meta(self.model)):
            return
        if mesh is not None:  # a copy built whole stays whole
            models = [self.model, *(self.frozen_copies if self._deferred else [])]
            broadcast = self.hparams.model_config is not None and not self._deferred
            offload = getattr(getattr(self._trainer, "strategy", None), "cpu_offload", False)  # ShardedStrategy's
            shard_models(models, mesh, lambda: str(self.trainer.precision), broadcast, offload)
        if is_meta(self.model):
            fill_models(self.hparams, [self.model, *self.frozen_copies], self.trainer.strategy, self._init_seed)
            self._place_backend(self.trainer.strategy.root_device)
            if self.precomputed is not None:
                self.precomputed.initial_weights = self.trainer.strategy.broadcast(weights_fingerprint(self.model))
        if mesh is not None:
            self.context = context_group(mesh, self.hf_model, self.packing, self.hparams)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint of another model in one line, before Lightning loads its weights (a size mismatch
        would otherwise end in a traceback); a LoRA run's checkpoint lacks the frozen weights by design. The
        precomputed reference log-probs it carries are the initial model's: they are used, never computed again."""
        if self.precomputed is not None:
            self.precomputed.load(checkpoint)
        trainer = self._trainer
        if trainer is not None and trainer.strategy.restore_checkpoint_after_setup:
            return  # FSDP loads (and removes) the weights itself, sharded: comparing would gather them on every rank
        if "state_dict" in checkpoint:  # `load_from_checkpoint(strict=...)` decides without a trainer
            check_checkpoint_weights(checkpoint["state_dict"], self.state_dict(), self.strict_loading and trainer
                                     is not None, getattr(trainer, "ckpt_path", None))  # fmt: skip

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the precomputed reference log-probs (32 bytes a pair): a resume uses the initial model's."""
        if self.precomputed is not None and self.precomputed.tables:
            checkpoint[CHECKPOINT_KEY] = self.precomputed.state()

    def on_fit_start(self) -> None:
        self.packing.route_mixers(self.model)  # on the trainer's device now: the probe decides any kernel route
        dtype = next(self.model.parameters()).dtype  # the precision plugin's (64-true converts the policy)
        for reference in self.frozen_copies:  # a packed model like the policy, on its device (a deferred one: already)
            if self._deferred:
                reference.to(dtype=dtype)
            else:
                pack_model(reference.to(self.device, dtype), self.attn_backend, self.device)
        self._prepare_reference("train", "val")

    def on_validation_start(self) -> None:
        if self.trainer.state.fn != "fit":  # `main.py validate`: no fit start computed the tables
            self._prepare_reference("val")

    def on_test_start(self) -> None:
        self._prepare_reference("test")

    def _prepare_reference(self, *stages: str) -> None:
        if self.precomputed is not None:
            self.precomputed.prepare(self, *stages)

    def on_train_start(self) -> None:
        if self.hparams.memory_check:
            self.memory_estimate = check_fit_memory(self, self._data.largest_step() if self._data else None)

    def largest_fitting(
        self, step_of: Callable[[int], StepShape], candidates: Sequence[int], what: str = "max_tokens",
        unit: str | None = None,
    ) -> tuple[int | None, MemoryEstimate]:  # fmt: skip
        """The largest step size that fits (`auto_size.largest_fitting`): what `max_tokens: auto` / `batch_size: auto`
        ask the model through `contract.largest_fitting`."""
        return largest_fitting(self, step_of, candidates, what, unit)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.hparams.compile:  # graphs compiled after the first step: shape changes that cost a recompile
            graphs = compiled_graphs()
            if self._graphs_after_first_step is None:
                self._graphs_after_first_step = graphs
            self.log("train/recompiles", float(graphs - self._graphs_after_first_step), on_step=True, on_epoch=False)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, Mapping):
            check_packed_batch(batch)
            if self.context is not None:
                check_dealable(batch)
        return batch

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Context parallel: this rank's share of the pack (`context.deal`), after the isolation self-test has run
        on the whole pack (under context parallelism, on the first training batch)."""
        if self.context is None or not isinstance(batch, Mapping):
            return batch
        if self._isolation_pending and self.trainer.training:
            self._check_isolation(batch)
        return deal(batch, self.context)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_rows.extend(batch.get(ROWS, ()))
        sync_gradients(self.model, self.trainer)  # FSDP2: reduce-scatter each micro-batch, or the step's last only
        # Every rank runs it on its first packed batch, an empty pack included: the same number of forwards on
        # every rank (see `sample_packed`), so a sharded model's collectives stay matched and nothing hangs.
        if self._isolation_pending and is_packed(batch):
            self._check_isolation(batch)

    def _check_isolation(self, batch: Mapping[str, Any]) -> None:
        group = torch.distributed.group.WORLD if self.trainer.world_size > 1 else None  # all stop if one fails
        with self.forward_context(), named_model_settings():
            diff = check_isolation(self.model, batch, self.attn_backend, context=self.context, group=group)
        log.info("isolation self-test passed: attn_backend=%s, max abs logit diff %.3g", self.attn_backend, diff)
        self._isolation_pending = False

    def forward_context(self):
        """The trainer's precision context for a forward outside the training step (none without a trainer)."""
        trainer = attached_trainer(self)
        return trainer.precision_plugin.forward_context() if trainer is not None else contextlib.nullcontext()

    # Steps: the loss, the optimizer step's guards, evaluation
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

    @property
    def handle(self) -> ModelHandle:
        """What the objective sees of this model: its forwards, the reference, the step it is on."""
        trainer, reference = attached_trainer(self), functools.partial(reference_forward, self)
        if trainer is None:
            return ModelHandle(self.loss_outputs, reference, self.precomputed)
        many = trainer.world_size > 1
        return ModelHandle(self.loss_outputs, reference, self.precomputed, lambda: trainer.global_step,
                           lambda: str(trainer.precision),
                           lambda t: trainer.strategy.reduce(t.to(self.device), reduce_op="max") if many else t,
                           lambda name, value: self.log(name, value, on_step=True, on_epoch=False))  # fmt: skip

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor:
        parts, metrics = self.objective.loss(self.handle, batch)
        normalizer = step_normalizer(batch, parts, self.objective.normalizer, self.trainer.world_size,
                                     self.trainer.accumulate_grad_batches)  # fmt: skip
        self._metric_names = list(metrics)
        values = [parts.token_loss_sum, parts.label_tokens, *(v for pair in metrics.values() for v in pair)]
        dtype = torch.float32 if parts.objective.device.type == "mps" else torch.float64  # MPS has no float64
        local = torch.stack([value.detach().to(dtype) for value in values])
        self._step_totals = local if self._step_totals is None else self._step_totals + local
        trainer = self.trainer
        factor = gradient_factor(type(trainer.strategy).__name__, trainer.world_size, trainer.accumulate_grad_batches)
        return parts.objective * (factor / normalizer)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Log `train/loss`, the step's per-token mean over all ranks: summed locally, reduced at logging steps only
        (one all-reduce every `trainer.log_every_n_steps`, none in between)."""
        totals, self._step_totals = self._step_totals, None
        trainer = self.trainer
        if totals is None:
            return
        rows, self._step_rows = self._step_rows, []
        if not finite_step(self, totals[0], rows):
            return
        if trainer.world_size > 1 and (trainer.global_step + 1) % trainer.log_every_n_steps and trainer.global_step:
            return
        totals = trainer.strategy.reduce(totals, reduce_op="sum")
        self.log("train/loss", totals[0] / totals[1].clamp_min(1), prog_bar=True, on_step=True, on_epoch=False)
        means = {}
        for k, name in enumerate(self._metric_names):  # the objective's metrics: (sum, count) each
            total, count = totals[2 + 2 * k], totals[3 + 2 * k]
            if count > 0:  # a metric of some steps only (an on-policy round's first) is logged on those
                means[name] = total / count
                self.log(f"train/{name}", means[name], on_step=True, on_epoch=False)
        self.objective.check_step(self.handle, {name: float(value) for name, value in means.items()})

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:  # fmt: skip
        """Sharded, clip by the norm of the whole gradient (`sharding.clip_grad_norm`: torch's own cannot combine
        the norms of tensor-parallel and replicated DTensor gradients); otherwise as Lightning does."""
        if is_sharded(self.model) and gradient_clip_val and gradient_clip_algorithm in (None, "norm"):
            clip_grad_norm(self.parameters(), gradient_clip_val)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def _eval_step(self, batch: Mapping[str, Any], stage: str) -> None:
        self.eval_totals.update(stage, *self.objective.evaluate(self.handle, batch, stage))

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val")

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")

    def _log_eval(self, stage: str) -> None:  # over every step and rank, then reset
        loss, accuracy = self.eval_totals.compute(stage)
        self.log(f"{stage}/loss", loss, prog_bar=True)
        for name in self.objective.eval_metrics:
            self.log(f"{stage}/{name}", loss.exp() if name == "perplexity" else accuracy)

    def configure_optimizers(self):
        return adamw_and_schedule(self, self.hparams)

    def on_fit_end(self) -> None:
        if self.hparams.export_dir:
            self.export(self.hparams.export_dir)

    def export(self, path: str) -> None:
        """Write the model as a Hugging Face folder (LoRA: merged, or its adapters) with the tokenizer (`export_lm`);
        sharded, a collective that no rank holds the whole model in."""
        trainer, data = attached_trainer(self), self._data
        tokenizer = None if data is None else data.processor or data.tokenizer  # a VLM's processor holds its tokenizer
        pretrained = self.hparams.name_or_path if self.hparams.model_config is None else None
        export_lm(self.model, path, tokenizer, pretrained, writer=trainer is None or trainer.is_global_zero,
                  adapters_only=self.hparams.export_adapters_only)  # fmt: skip
