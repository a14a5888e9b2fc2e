"""ShardedStrategy: Lightning's `ModelParallelStrategy` (FSDP2, tensor parallel) whose distributed checkpoints are
written atomically.

    Trainer(strategy=ShardedStrategy(data_parallel_size=2, tensor_parallel_size=1))   # configs/fsdp2.yaml

Lightning writes a distributed checkpoint into its folder in place: every rank's shards, then rank 0's `meta.pt`
(the loops, the data position). Rewriting a folder (`last.ckpt` at every save) and being killed part-way left new
shards beside the previous `meta.pt`: a folder that reads as complete and holds two steps' weights. Here every
rank writes the whole checkpoint under a hidden name beside it (`.last.ckpt.partial`), and once all have, rank 0
renames it over the previous one (`checkpoint_io.replace_folder`); a kill at any moment leaves the previous
checkpoint or the new one. The CLI takes `--trainer.strategy=ModelParallelStrategy` as this class (the same
settings); reading, loading and everything else are Lightning's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy

from lit_packing.checkpoint_io import PARTIAL_SUFFIX, hidden, is_local, remove, replace_folder

LIGHTNING_MODEL_PARALLEL = "lightning.pytorch.strategies.ModelParallelStrategy"


class ShardedStrategy(ModelParallelStrategy):
    """`ModelParallelStrategy` with atomic distributed checkpoints (the module's docstring)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if not self._save_distributed_checkpoint or storage_options is not None or not is_local(filepath):
            super().save_checkpoint(checkpoint, filepath, storage_options)  # one file (AtomicCheckpointIO), or remote
            return
        path = Path(self.broadcast(str(filepath)))
        partial = hidden(path, PARTIAL_SUFFIX)
        if self.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            remove(partial)  # what a save killed before its renames left
        self.barrier("partial checkpoint cleared")
        super().save_checkpoint(checkpoint, partial)  # every rank's shards, then rank 0's meta.pt
        self.barrier("partial checkpoint written")
        if self.is_global_zero:
            replace_folder(partial, path)
        self.barrier("checkpoint in place")
