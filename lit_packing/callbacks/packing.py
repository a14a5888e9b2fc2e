"""PackingMonitor: how full every step is, from the host-side counts the collator puts in each batch.

    Trainer(callbacks=[PackingMonitor()])   # logs train/padding_ratio, train/packing_efficiency, ...

No tensor is read back from the device: every number comes from `batch["counts"]` (Python ints).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import lightning.pytorch as pl
import torch

from lit_packing.batch import COUNTS, SOURCE_TOKENS, WINDOW
from lit_packing.contract import DataContract

STARVED_S = 0.01  # a stream's step that waited longer than this for data is counted as starved


def padding_metrics(counts: dict[str, int]) -> dict[str, float]:
    """Per-step packing metrics from one batch's (or a sum of batches') counts.

    Example: 28 real tokens in 32 slots -> padding_ratio 0.125, packing_efficiency 0.875.
    """
    slots = max(counts["slot_tokens"], 1)
    return {
        "padding_ratio": (counts["slot_tokens"] - counts["real_tokens"]) / slots,
        "packing_efficiency": counts["real_tokens"] / slots,
    }


class PackingMonitor(pl.Callback):
    """Log padding ratio, packing efficiency, examples, real / label tokens per step and per epoch.

    Per optimizer step (`train/...`, summed over its gradient-accumulation micro-batches, this rank's batches):
    `padding_ratio` (pad slots / slots), `packing_efficiency` (real / slots), `examples_per_step`, `real_tokens`,
    `label_tokens`, `truncated_tokens` (cut from this step's examples by the data's overlong policy) and, for image
    chats, `image_tokens` (the tokens that hold an image's features, `ImageChatCollator`'s count). Once, when
    training starts (`data/...`, at step 0): every count of the data module's `TokenizationReport`, e.g.
    `data/truncated_tokens`, `data/dropped_overlong_examples` (dataset-level: removed before sampling),
    `data/bad_examples` (skipped under `data.on_bad_row=skip`), `data/duplicate_examples` and
    `data/val_overlap_examples` (validation examples also in training). Per epoch:
    `train/epoch_padding_ratio`, `train/epoch_packing_efficiency`. With several ranks, at logging steps:
    `train/rank_token_imbalance` and `train/rank_attn_imbalance` (max / mean over ranks of real tokens and of
    attention cost sum(L^2)). From a stream (`data.streaming`), per optimizer step: `train/window_fill` (real tokens
    of the window being trained / its packs' token budget), `train/data_wait_s` (seconds the step waited for
    tokenized data: 0 when the workers keep ahead), `train/starved_steps` (steps so far that waited over 10 ms),
    `train/data_examples_per_sec` (rows the workers tokenize per second of their time, times the workers: the
    pipeline's capacity), and at logging steps `train/source_share/<name>` (each source's share of the real tokens
    trained so far in this launch, over all ranks).

    Args:
        prog_bar: show padding ratio in the progress bar.
    """

    def __init__(self, prog_bar: bool = True) -> None:
        self.prog_bar = prog_bar
        self.epoch_totals: Counter[str] = Counter()
        self._step_counts: Counter[str] = Counter()  # the micro-batches of the optimizer step under way
        self._data: DataContract | None = None
        self.source_tokens: Counter[int] = Counter()  # a stream's real tokens per source, this launch, this rank
        self._window: dict[str, Any] | None = None
        self._waited = 0.0
        self.starved_steps = 0  # steps of a stream that waited on the data

    def connect_data(self, data: DataContract) -> None:
        """The data's contract (`lit_packing.contract`): its tokenization report is logged at train start."""
        self._data = data

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._data is None or self._data.report is None or not trainer.is_global_zero:
            return
        counts = {f"data/{name}": float(value) for name, value in self._data.report.as_dict().items()}
        counts["data/val_overlap_examples"] = float(self._data.overlap_examples)
        for logger in trainer.loggers:
            logger.log_metrics(counts, step=trainer.global_step)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epoch_totals = Counter()
        self._step_counts = Counter()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_counts.update(batch[COUNTS])
        if SOURCE_TOKENS in batch:
            self.source_tokens.update(dict(enumerate(batch[SOURCE_TOKENS])))
            self._window = batch[WINDOW]

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # Logged once per optimizer step, over all its gradient-accumulation micro-batches.
        counts, self._step_counts = self._step_counts, Counter()
        if not counts:
            return
        self.epoch_totals.update(counts)
        step = padding_metrics(counts)
        metrics = {
            "train/padding_ratio": step["padding_ratio"],
            "train/packing_efficiency": step["packing_efficiency"],
            "train/examples_per_step": float(counts["examples"]),
            "train/real_tokens": float(counts["real_tokens"]),
            "train/label_tokens": float(counts["label_tokens"]),
            "train/truncated_tokens": float(counts["truncated_tokens"]),
        }
        if "image_tokens" in counts:  # image chats' batches count them
            metrics["train/image_tokens"] = float(counts["image_tokens"])
        logging_step = trainer.global_step % max(trainer.log_every_n_steps, 1) == 0
        if trainer.world_size > 1 and logging_step:
            metrics.update(self._rank_imbalance(pl_module, counts))
        if self._window is not None:
            metrics.update(self._stream_metrics(trainer, pl_module, logging_step))
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1, prog_bar=False)
        if self.prog_bar:
            pl_module.log("pad", step["padding_ratio"], on_step=True, batch_size=1, prog_bar=True, logger=False)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.epoch_totals:
            return
        epoch = padding_metrics(self.epoch_totals)
        pl_module.log("train/epoch_padding_ratio", epoch["padding_ratio"], on_epoch=True, batch_size=1)
        pl_module.log("train/epoch_packing_efficiency", epoch["packing_efficiency"], on_epoch=True, batch_size=1)

    def _stream_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule, logging_step: bool) -> dict:
        window, metrics = self._window, {}
        if window.get("fill") is not None:
            metrics["train/window_fill"] = window["fill"]
        waited, self._waited = window["waited_s"] - self._waited, window["waited_s"]
        self.starved_steps += waited > STARVED_S
        metrics["train/data_wait_s"] = max(waited, 0.0)
        metrics["train/starved_steps"] = float(self.starved_steps)
        metrics["train/data_examples_per_sec"] = window["examples_per_sec"]
        if logging_step and self._data is not None and self._data.sources:
            names = [name for name, _ in self._data.sources]
            local = torch.tensor([float(self.source_tokens[i]) for i in range(len(names))], dtype=torch.float64)
            if trainer.world_size > 1:
                local = trainer.strategy.reduce(local.to(pl_module.device), reduce_op="sum").cpu()
            total = max(float(local.sum()), 1.0)
            metrics.update({f"train/source_share/{n}": float(v) / total for n, v in zip(names, local.tolist())})
        return metrics

    @staticmethod
    def _rank_imbalance(pl_module: pl.LightningModule, counts: dict[str, int]) -> dict[str, float]:
        local = torch.tensor([counts["real_tokens"], counts["attn_cost"]], dtype=torch.float64, device=pl_module.device)
        gathered = pl_module.all_gather(local).reshape(-1, 2)  # (world_size, 2)
        ratio = (gathered.max(0).values / gathered.mean(0).clamp_min(1)).tolist()
        return {"train/rank_token_imbalance": ratio[0], "train/rank_attn_imbalance": ratio[1]}
