"""The toolkit's strategies: `ShardedStrategy`, Lightning's `ModelParallelStrategy` (FSDP2, tensor parallel) with a
context-parallel dimension and distributed checkpoints written atomically, and `DDPStrategy`, Lightning's DDP. Both
give up on a rank that stopped answering after `PROCESS_GROUP_TIMEOUT`.

    Trainer(strategy=ShardedStrategy(data_parallel_size=2, tensor_parallel_size=1))   # configs/fsdp2.yaml
    Trainer(strategy=ShardedStrategy(context_parallel_size=2))                        # configs/context_parallel.yaml
    Trainer(strategy=DDPStrategy(timeout=300))                                        # configs/multinode.yaml

The process group's `timeout` is how long a collective waits for a rank before it fails: a rank killed, hung or cut
off leaves the others waiting in their next collective. Lightning passes torch's 30 minutes to every backend (NCCL's
own default is 10); here it is 10 minutes, set in seconds (`--trainer.strategy.init_args.timeout=300`) or as
h:m:s (`0:05:00`). Single-process runs (`strategy: auto` on one device) have no process group and are untouched.

With `context_parallel_size` > 1 the device mesh has three dims, `data_parallel` x `context_parallel` x
`tensor_parallel` (Lightning's two with one between them): the data is dealt over the data-parallel ranks only (the
ranks of one context-parallel group train the same pack, each its share of the tokens: `models.context`), and
FSDP2 shards over data x context ranks.

Lightning writes a distributed checkpoint into its folder in place: every rank's shards, then rank 0's `meta.pt`
(the loops, the data position). Rewriting a folder (`last.ckpt` at every save) and being killed part-way left new
shards beside the previous `meta.pt`: a folder that reads as complete and holds two steps' weights. Here every
rank writes the whole checkpoint under a hidden name beside it (`.last.ckpt.partial`), and once all have, rank 0
renames it over the previous one (`checkpoint_io.replace_folder`); a kill at any moment leaves the previous
checkpoint or the new one. The CLI takes `--trainer.strategy=ModelParallelStrategy` as `ShardedStrategy` (the same
settings), and `--trainer.strategy=ddp` as `DDPStrategy`; reading, loading and everything else are Lightning's.
"""

from __future__ import annotations

import math
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch import strategies as lightning_strategies
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.device_mesh import init_device_mesh

from lit_packing._compat import model_parallel_sizes, set_model_parallel
from lit_packing.checkpoint_io import PARTIAL_SUFFIX, hidden, is_local, remove, replace_folder
from lit_packing.errors import ConfigError
from lit_packing.models.context import CP_SIZE_SETTING
from lit_packing.models.sharding import GradientAccumulation

LIGHTNING_MODEL_PARALLEL = "lightning.pytorch.strategies.ModelParallelStrategy"
LIGHTNING_DDP = "lightning.pytorch.strategies.DDPStrategy"

# How long a collective waits for a rank that stopped answering before it fails, on every rank (module docstring).
PROCESS_GROUP_TIMEOUT = timedelta(minutes=10)
TIMEOUT_SETTING = "trainer.strategy.init_args.timeout"


def process_group_timeout(timeout: float | timedelta) -> timedelta:
    """`timeout` as torch takes it: seconds (`600`), or what jsonargparse reads from `0:10:00`.

    >>> process_group_timeout(90), process_group_timeout(timedelta(minutes=10))
    (datetime.timedelta(seconds=90), datetime.timedelta(seconds=600))

    Raises:
        ConfigError: not a positive duration (naming `trainer.strategy.init_args.timeout`).
    """
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(TIMEOUT_SETTING, f"{timeout!r} is not a positive duration",
                          "give seconds (600) or h:m:s (0:10:00)")  # fmt: skip
    return timedelta(seconds=seconds)


class DDPStrategy(lightning_strategies.DDPStrategy):
    """Lightning's `DDPStrategy` with the toolkit's process-group timeout (the module's docstring); the CLI runs
    `--trainer.strategy=ddp` as this class. Its class name is Lightning's: the loss and quantization checks that
    accept DDP by name accept it (nothing else differs).

    Args:
        timeout: seconds (or a `timedelta`) a collective waits for a rank before it fails; 10 minutes by default.
            Kept as `timeout`, a `timedelta`.
        **kwargs: Lightning's `DDPStrategy`'s.
    """

    def __init__(self, timeout: float | timedelta = PROCESS_GROUP_TIMEOUT, **kwargs: Any) -> None:
        self.timeout = process_group_timeout(timeout)
        super().__init__(timeout=self.timeout, **kwargs)


MESH_DIMS = ("data_parallel", "context_parallel", "tensor_parallel")


class ShardedStrategy(ModelParallelStrategy):
    """`ModelParallelStrategy` with a context-parallel dim and atomic distributed checkpoints (the module's
    docstring).

    Args:
        data_parallel_size: ranks that train different packs (`auto`: what the other two leave of the world).
        context_parallel_size: ranks that train one pack together, each its share of the tokens (1: none).
        tensor_parallel_size: ranks that split each layer's heads and MLP columns (`auto`: 1).
        cpu_offload: keep the sharded parameters, gradients and AdamW state in host memory between uses (FSDP2's
            `CPUOffloadPolicy`): device memory for what a step gathers and computes, at the cost of host-device
            copies every step and an optimizer step on the host. On GPUs the process group then gets a gloo backend
            for host tensors beside NCCL (`cuda:nccl,cpu:gloo`): gradient clipping's norm, the finite-shards check
            and the export reduce and send shards that live on the host, which NCCL cannot.
        timeout: seconds (or a `timedelta`) a collective waits for a rank before it fails; 10 minutes by default.
            Kept as `timeout`, a `timedelta`.
        gradient_accumulation: with several micro-batches a step (`accumulate_grad_batches`, `data.packs_per_step`
            on fewer ranks), `sharded` (default) reduce-scatters each micro-batch's gradients into the shards, so a
            rank holds a shard's gradients between micro-batches (one reduce-scatter per layer and micro-batch);
            `unsharded` reduce-scatters at the step's last micro-batch only and holds every layer's whole gradient
            in between (one reduce-scatter a step: less communication, the whole model's gradients in memory). The
            memory estimate counts the one chosen.
        **kwargs: `ModelParallelStrategy`'s.
    """

    def __init__(self, data_parallel_size: Literal["auto"] | int = "auto",
                 tensor_parallel_size: Literal["auto"] | int = "auto", context_parallel_size: int = 1,
                 cpu_offload: bool = False, timeout: float | timedelta = PROCESS_GROUP_TIMEOUT,
                 gradient_accumulation: GradientAccumulation = "sharded", **kwargs: Any) -> None:  # fmt: skip
        if gradient_accumulation not in ("sharded", "unsharded"):
            raise ConfigError("trainer.strategy.init_args.gradient_accumulation", f"{gradient_accumulation!r} is "
                              "not a way to accumulate", "set sharded or unsharded")  # fmt: skip
        self.gradient_accumulation = gradient_accumulation
        self.timeout = process_group_timeout(timeout)
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                         timeout=self.timeout, **kwargs)  # fmt: skip
        self.cpu_offload = cpu_offload
        if not isinstance(context_parallel_size, int) or context_parallel_size < 1:
            raise ConfigError(CP_SIZE_SETTING, f"{context_parallel_size!r} is not a number of ranks",
                              "set it to 1 or more")  # fmt: skip
        self.context_parallel_size = context_parallel_size

    def _get_process_group_backend(self) -> str:
        """Lightning's (NCCL on GPUs, gloo on CPUs, or `process_group_backend` as given), with gloo for host tensors
        beside NCCL when the shards live on the host (`cpu_offload`)."""
        backend = super()._get_process_group_backend()
        return "cuda:nccl,cpu:gloo" if self.cpu_offload and backend == "nccl" else backend

    def setup_environment(self) -> None:
        """Lightning's, with `auto` sizes meaning one thing on any number of ranks (tensor parallel 1, data parallel
        what the other two leave; Lightning's own `auto` would shard over the nodes only), and with context
        parallelism the 3-D mesh in place of its 2-D one.

        Raises:
            ConfigError: the sizes do not multiply to the world size (naming the setting).
        """
        cp = self.context_parallel_size
        world = self.num_nodes * self.num_processes
        dp, tp = model_parallel_sizes(self)
        tp = 1 if tp == "auto" else int(tp)
        dp = world // (cp * tp) if dp == "auto" else int(dp)
        if dp * cp * tp != world:
            blamed = "tensor" if model_parallel_sizes(self)[0] == "auto" else "data"  # auto data parallel fits any
            setting = CP_SIZE_SETTING if cp > 1 else f"trainer.strategy.init_args.{blamed}_parallel_size"
            raise ConfigError(setting, f"data_parallel_size={dp} x context_parallel_size={cp} x tensor_parallel_size="
                              f"{tp} is not the {world} ranks (trainer.devices x trainer.num_nodes)",
                              "make them multiply to the ranks (data_parallel_size: auto takes what the other two "
                              "leave)")  # fmt: skip
        set_model_parallel(self, dp * cp, tp)  # Lightning's 2-D mesh, which checks them against the world
        super().setup_environment()
        if cp > 1:
            mesh = init_device_mesh(self.root_device.type, (dp, cp, tp), mesh_dim_names=MESH_DIMS)
            set_model_parallel(self, dp, tp, mesh)

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
