"""FSDP2 for a packed model: `fully_shard` each decoder layer, then the root, on a device mesh's data-parallel dim,
after splitting attention heads and MLP columns over its tensor-parallel dim when that dim has several ranks.

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    shard_model(model, mesh, precision="bf16-mixed")   # in place; PackedCausalLM.configure_model does this
    sync_gradients(model, trainer)                      # before a micro-batch: reduce-scatter it, or not yet

Layers are the model's own `_no_split_modules` classes (what transformers names as the unit never to split), so
each decoder layer is one all-gather in the forward and one reduce-scatter in the backward; the root group holds
what is left (embeddings, final norm, the LM head). The gradient reduction is a plain sum over the data-parallel
ranks (`set_gradient_divide_factor(1)`, sum-only collectives): the loss is already divided by the optimizer step's
global label count, so a sum is the step's gradient, set explicitly rather than left to the backend's default
(FSDP2 over gloo has been reported to sum where NCCL averages).

Tensor parallel (`tensor_parallel_plan`) follows the model's own plan, transformers' `base_model_tp_plan` (Llama: q,
k, v and the MLP's gate and up projections column-wise, o and down projections row-wise), applied with torch's
`parallelize_module` before FSDP2 shards over the data-parallel sub-mesh (2-D: each parameter a DTensor sharded on
both dims). Each rank's attention then runs its own heads on the whole packed row: a column-wise projection's
output is the local heads' columns, which the attention reshapes with -1 heads, and the row-wise projection after it
sums the heads' contributions over the tensor-parallel ranks. The embeddings, norms and LM head stay whole on every
tensor-parallel rank (replicated, sharded over data-parallel ranks only), so the loss, which reads the final hidden
states and the head's weight, runs as without tensor parallel. Tensor-parallel peers train the same batches (the
data is dealt by data-parallel rank), so a replicated parameter's gradient is already the same on each.

Mixed precision follows the trainer's precision: `bf16-mixed` gathers bf16 parameters and reduces gradients in
fp32 (`16-mixed` likewise with fp16); the sharded parameters and the optimizer state stay in their own dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal, NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from lit_packing._compat import accumulates, flatten_mesh
from lit_packing.errors import ConfigError

DATA_PARALLEL = "data_parallel"  # Lightning's ModelParallelStrategy names its mesh dims so
TENSOR_PARALLEL = "tensor_parallel"
CONTEXT_PARALLEL = "context_parallel"  # ShardedStrategy's third dim, between them
DATA_CONTEXT = "data_context_parallel"  # the two flattened: what FSDP2 shards over with context parallelism
# Trainer precision -> the dtype FSDP2 gathers parameters in (gradients are reduced in fp32 whenever it is set).
PARAM_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
TP_SIZE_SETTING = "trainer.strategy.init_args.tensor_parallel_size"
# transformers' names of the tensor-parallel styles in a config's `base_model_tp_plan` -> torch's style: the two a
# dense decoder's plan is made of (output split by columns, which the next op reads as local heads or local MLP
# columns; input split likewise, output summed over the ranks). Any other (norms whose gradients must be summed over
# the heads, experts, packed projections) is refused rather than run unsplit.
TP_STYLES: dict[str, type[ParallelStyle]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


class ShardPlan(NamedTuple):
    """What `shard_model` wraps: each decoder layer (by qualified name), then the root."""

    layers: list[str]
    layer_class: str


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """The FSDP2 policy for a trainer precision: `bf16-mixed` -> bf16 parameters, fp32 gradient reduction;
    `16-mixed` -> fp16 and fp32; true precisions (`32-true`, `bf16-true`, `64-true`) -> the parameters' own dtype.

    >>> policy = mixed_precision_policy("bf16-mixed")
    >>> policy.param_dtype, policy.reduce_dtype
    (torch.bfloat16, torch.float32)
    >>> mixed_precision_policy("32-true").param_dtype is None
    True
    """
    dtype = PARAM_DTYPES.get(str(precision))
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype is not None else None)


def shard_plan(model: torch.nn.Module) -> ShardPlan:
    """The decoder layers `shard_model` wraps one by one: the modules whose class the transformers model names in
    `_no_split_modules`, outermost first. A vision-language model's are its language model's: the vision tower and
    the connector stay with the root, gathered once a step with the embeddings and the head, so every rank runs the
    same collectives whether its pack holds an image or not.

    Raises:
        ConfigError: the model names no such class, or none of its modules is one (naming the model).
    """
    base = _base(model)
    names = set(getattr(base, "_no_split_modules", None) or ())
    within = ""
    if getattr(getattr(base, "config", None), "vision_config", None) is not None:
        decoder = base.get_decoder()
        names = set(getattr(decoder, "_no_split_modules", None) or ())
        within = next(name for name, module in base.named_modules() if module is decoder) + "."
    # By class name along the MRO: a sharded layer's class is FSDP2's subclass of it (`FSDPLlamaDecoderLayer`).
    layers = [name for name, module in base.named_modules()
              if name.startswith(within) and names & {c.__name__ for c in type(module).__mro__}]  # fmt: skip
    # A layer inside another listed layer is sharded with it.
    outer = [name for name in layers if not any(name.startswith(other + ".") for other in layers)]
    if not outer:
        raise ConfigError(
            "trainer.strategy",
            f"{type(base).__name__} names no decoder layer class (`_no_split_modules`) to shard layer by layer",
            "train it with trainer.strategy=ddp",
        )
    layer_class = next(c.__name__ for c in type(base.get_submodule(outer[0])).__mro__ if c.__name__ in names)
    return ShardPlan(outer, layer_class)


def tensor_parallel_plan(model: torch.nn.Module, size: int) -> dict[str, ParallelStyle]:
    """`model`'s own tensor-parallel plan (its config's `base_model_tp_plan`, module names relative to the
    transformers base model, `*` for each layer index) as torch's styles, checked for `size` ranks.

    Raises:
        ConfigError: (naming `trainer.strategy.init_args.tensor_parallel_size` and the model family) the family
            has no plan, the plan holds a style not in `TP_STYLES`, the attention or key/value heads do not divide
            by `size`, or the model carries LoRA adapters (their layers are not the plain linears a style splits).
    """
    base = _base(model)
    config = base.config.get_text_config()
    family = config.model_type

    def refuse(problem: str, fix: str) -> ConfigError:
        return ConfigError(TP_SIZE_SETTING, f"{size} on {family}: {problem}", fix)

    one = "set it to 1 (data_parallel_size to the world size)"
    if base is not model:
        raise refuse("a LoRA model's adapted layers are not split by tensor parallel", f"{one}, or drop model.lora")
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise refuse("the model family has no tensor-parallel plan (`base_model_tp_plan`)", one)
    unknown = sorted({style for style in plan.values() if style not in TP_STYLES})
    if unknown:
        raise refuse(
            f"its plan holds tensor-parallel styles {', '.join(map(repr, unknown))} that are not handled (only "
            f"{', '.join(TP_STYLES)})",
            one,
        )
    heads = {"attention heads": config.num_attention_heads,
             "key/value heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads}  # fmt: skip
    for what, count in heads.items():
        if count % size:
            raise refuse(f"its {count} {what} do not divide into {size} equal groups", "use a size that divides them")
    return {name: TP_STYLES[style]() for name, style in plan.items()}


def tensor_parallel(model: torch.nn.Module, tp_mesh: DeviceMesh) -> dict[str, ParallelStyle]:
    """Split `model`'s base model over the 1-D `tp_mesh` by `tensor_parallel_plan`, in place; returns that plan."""
    plan = tensor_parallel_plan(model, tp_mesh.size())
    parallelize_module(model.base_model, tp_mesh, plan)
    return plan


def shard_model(
    model: torch.nn.Module, mesh: DeviceMesh, precision: str, reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> ShardPlan:  # fmt: skip
    """With several tensor-parallel ranks in `mesh`, split `model` over them (`tensor_parallel`); then
    `fully_shard` every decoder layer of `model` (`shard_plan`), then the root, over `mesh`'s data-parallel
    dim, in place; gradients reduced as a sum (see the module docstring). Returns the plan it applied.

    Args:
        model: the transformers model (or a peft model around one) on its device or on the host.
        mesh: Lightning's `ModelParallelStrategy.device_mesh` (dims `data_parallel`, `tensor_parallel`), or a 1-D
            mesh of the data-parallel ranks.
        precision: the trainer's precision (`mixed_precision_policy`).
        reshard_after_forward: free each decoder layer's gathered parameters after its forward (gathered again
            in the backward): memory of one layer's parameters at a time instead of all of them, for one more
            all-gather per layer.
        cpu_offload: keep the sharded parameters, their gradients and so the optimizer state in host memory
            (FSDP2's `CPUOffloadPolicy`): each group's parameters are copied to the device for its forward and
            backward, its gradients back after the reduce-scatter, and the optimizer steps on the host. Pinned
            memory where there is a CUDA device; on CPU ranks everything is host memory already.
    """
    plan = shard_plan(model)
    if tensor_parallel_size(mesh) > 1:
        tensor_parallel(model, mesh[TENSOR_PARALLEL])
    dp_mesh = data_parallel_mesh(mesh)
    policy = mixed_precision_policy(precision)
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    base = _base(model)
    for name in plan.layers:
        fully_shard(base.get_submodule(name), mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=policy, offload_policy=offload)  # fmt: skip
    # The root is left to FSDP2's own rule (None: kept gathered from its forward to its backward), so that the LM
    # head the chunked loss runs after the forward (`head.head_inputs`) holds its whole weight. It is the
    # transformers model, inside a peft model's wrappers, so that a forward of the transformers model alone
    # (`head.head_inputs`, the reference pass) gathers it too.
    fully_shard(base, mesh=dp_mesh, reshard_after_forward=None, mp_policy=policy, offload_policy=offload)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return plan


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks FSDP2 shards over: the data-parallel sub-mesh of Lightning's 2-D mesh, or with context
    parallelism the data x context ranks flattened (a 1-D mesh is taken as it is)."""
    names = mesh.mesh_dim_names or ()
    if context_parallel_size(mesh) > 1:
        return flatten_mesh(mesh, (DATA_PARALLEL, CONTEXT_PARALLEL), DATA_CONTEXT)
    return mesh[DATA_PARALLEL] if DATA_PARALLEL in names and mesh.ndim > 1 else mesh


def context_parallel_size(mesh: DeviceMesh | None) -> int:
    """The ranks of ShardedStrategy's context-parallel dim (1 on a mesh without one)."""
    return mesh[CONTEXT_PARALLEL].size() if mesh is not None and CONTEXT_PARALLEL in (mesh.mesh_dim_names or ()) else 1


def tensor_parallel_size(mesh: DeviceMesh) -> int:
    """The ranks of Lightning's tensor-parallel dim (1 on a mesh without one)."""
    return mesh[TENSOR_PARALLEL].size() if TENSOR_PARALLEL in (mesh.mesh_dim_names or ()) else 1


def shard_count(mesh: DeviceMesh | None) -> int:
    """Over how many ranks each parameter, its gradient and its optimizer state are split (1 without a mesh): the
    data-parallel ranks times the tensor-parallel ones. With tensor parallel this counts the replicated embeddings,
    norms and LM head as split too (they are over the data-parallel ranks only): what the memory estimate divides
    by, and says so."""
    return 1 if mesh is None else data_parallel_mesh(mesh).size() * tensor_parallel_size(mesh)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `shard_model` sharded `model` (its transformers model is FSDP2's root)."""
    return isinstance(_base(model), FSDPModule)


def reshard(model: torch.nn.Module) -> None:
    """Free every gathered parameter of a sharded model (a no-op otherwise). A forward without a backward (the
    reference pass) leaves the root gathered, as it is kept gathered from
    its forward to its backward: the embeddings and head whole on every rank until the next backward."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def sync_gradients(model: torch.nn.Module, trainer: Any) -> None:
    """Before a micro-batch's backward: reduce-scatter its gradients into the sharded ones (`gradient_accumulation`
    `sharded`, the default: a rank holds a shard's gradients between micro-batches, one reduce-scatter per group
    and micro-batch), or only at the optimizer step's last micro-batch (`unsharded`: the others accumulate whole
    gradients locally, as DDP's `no_sync` does; one reduce-scatter a step, every layer's whole gradient held in
    between). Lightning's loop does not do this for FSDP2 itself. A no-op for a model `shard_model` did not wrap."""
    root = _base(model)
    if isinstance(root, FSDPModule):
        reduce = not accumulates(trainer) or gradient_accumulation(trainer.strategy) == "sharded"
        root.set_requires_gradient_sync(reduce)
        root.set_is_last_backward(reduce)


GradientAccumulation = Literal["sharded", "unsharded"]


def gradient_accumulation(strategy: Any) -> GradientAccumulation:
    """How a sharded strategy accumulates gradients over a step's micro-batches (`ShardedStrategy`'s setting;
    `sharded` for any other strategy, Lightning's `ModelParallelStrategy` included)."""
    return getattr(strategy, "gradient_accumulation", "sharded")


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the gradients of a sharded model's `parameters` to a global 2-norm of at most `max_norm`, in place;
    returns the norm before clipping (the same on every rank).

    torch's `clip_grad_norm_` stacks every gradient's norm into one tensor, which DTensors refuse across meshes: with
    tensor parallel, the split weights live on the 2-D mesh and the replicated ones (embeddings, norms) on the
    data-parallel sub-mesh. Here each mesh's gradients give one norm (a DTensor whose placements say how its shards
    combine), made whole with one all-reduce per mesh (`full_tensor`), so a replicated gradient counts once, not
    once per tensor-parallel rank."""
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            by_mesh.setdefault(param.grad.device_mesh if isinstance(param.grad, DTensor) else None, []).append(param)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in by_mesh.values()]
    whole = [norm.full_tensor() if isinstance(norm, DTensor) else norm for norm in norms]
    total = torch.linalg.vector_norm(torch.stack(whole))
    for group in by_mesh.values():  # one foreach scaling per mesh: torch's foreach ops take a single mesh
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def gathered_parameter_bytes(model: torch.nn.Module, mixed: bool) -> int:
    """What a sharded model holds whole at once beyond its shards: the root's parameters (embeddings, final norm, LM
    head: gathered from the forward to the backward) and two decoder layers' (the one running and the one gathered
    ahead of it), in the dtype they are gathered in (2 bytes under mixed precision); with tensor parallel, a layer's
    split weights count this rank's part (`gathered_numel`).

    >>> layer = torch.nn.Linear(4, 4, bias=False)            # 16 parameters
    >>> model = torch.nn.Sequential(torch.nn.Embedding(10, 4), layer)
    >>> model._no_split_modules = ["Linear"]
    >>> gathered_parameter_bytes(model, mixed=False)          # 4 * (40 root + 2 * 16 layer)
    288
    """
    plan = shard_plan(model)
    base = _base(model)

    def size(params) -> int:
        return sum(gathered_numel(p) * (2 if mixed and p.is_floating_point() else p.element_size()) for p in params)

    layers = [size(base.get_submodule(name).parameters()) for name in plan.layers]
    in_layers = {id(p) for name in plan.layers for p in base.get_submodule(name).parameters()}
    root = size(p for p in model.parameters() if id(p) not in in_layers)
    return root + 2 * max(layers)


def gathered_numel(param: torch.Tensor) -> int:
    """How many elements of `param` FSDP2's all-gather holds on a rank: the whole parameter, divided by the ranks
    of every other mesh dim it is sharded on (tensor parallel's)."""
    if not isinstance(param, DTensor):
        return param.numel()
    mesh, names = param.device_mesh, param.device_mesh.mesh_dim_names or ()
    split = [mesh.size(dim) for dim, placement in enumerate(param.placements)
             if placement.is_shard() and names[dim : dim + 1] not in ((DATA_PARALLEL,), (DATA_CONTEXT,))]  # fmt: skip
    return param.numel() // math.prod(split)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) parameter or gradient; a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model
