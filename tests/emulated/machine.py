"""A simulated GPU machine: `torch.cuda` reports an sm90 device, and only the lowest CUDA kernels are replaced.

    with SimulatedGPU() as gpu:          # or the `emulated_gpu` fixture
        lm = PackedCausalLM(...)         # what a GPU user's process does, unchanged
        Trainer(accelerator="gpu", precision="bf16-mixed").fit(lm, dm)

What is real: PyTorch's `varlen_attn` (its custom op, fake kernel and autograd formula), flash-attn's own Python
interface (`flash_attn_varlen_func`, its custom ops and padding, from the flash-attn sdist, never built), the
product's attention functions, transformers, Lightning's CUDA accelerator, autocast and GradScaler flows. What is
replaced: the CUDA kernels `aten::_flash_attention_forward` / `_backward` (registered here for the CPU dispatch key)
and the compiled `flash_attn_2_cuda` extension (a stand-in module), both computed by `kernels.py`; the `torch.cuda`
queries a CPU build cannot answer; and device placement: tensors moved to `cuda` stay in host memory.

Host and device are told apart per process: until something is moved to the device (`.to("cuda")`, `.cuda()`, a
factory with `device="cuda"`), a kernel call fails exactly as a CUDA kernel given host tensors does ("Could not run
... with arguments from the 'CPU' backend"), which is what a forward run before the strategy places the model hits.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.overrides import TorchFunctionMode

from tests.emulated import kernels

REPO = Path(__file__).resolve().parents[2]
# flash-attn's Python package, unpacked from its PyPI sdist by `make emulated` (nothing compiled).
FLASH_ATTN_SDIST = REPO / "build" / "emulated" / "flash-attn"
STAND_IN = Path(__file__).resolve().parent / "stand_in"

_ACTIVE: SimulatedGPU | None = None


def current_machine(op: str, *tensors: torch.Tensor) -> SimulatedGPU:
    """The active machine, when the tensors would be on its device; else the error a CUDA kernel raises for host
    tensors (NotImplementedError naming the op and the 'CPU' backend)."""
    machine = _ACTIVE
    if machine is None or not machine.placed:
        raise NotImplementedError(
            f"Could not run '{op}' with arguments from the 'CPU' backend. This could be because the operator doesn't "
            "exist for this backend, or was omitted during the selective/custom build process (if using custom "
            "build). (emulated: the tensors are still on the host; nothing was moved to the GPU)"
        )
    machine.kernel_calls[op] = machine.kernel_calls.get(op, 0) + 1
    return machine


def _is_cuda(x) -> bool:
    if isinstance(x, torch.device):
        return x.type == "cuda"
    return isinstance(x, str) and x.split(":")[0] == "cuda"


def _host(x):
    return torch.device("cpu") if isinstance(x, torch.device) else "cpu"


_NAMES_ONLY = (torch.device, torch._C._nn._parse_to)


class _Placement(TorchFunctionMode):
    """Every `device="cuda"` (factories, `.to`, `.cuda()`) lands in host memory and marks the machine placed."""

    def __init__(self, machine: SimulatedGPU):
        super().__init__()
        self.machine = machine

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NAMES_ONLY:  # a device's name is not a placement: `torch.device("cuda")` stays cuda
            return func(*args, **kwargs)
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            self.machine.placed = True
            return args[0]
        if any(_is_cuda(a) for a in args) or any(_is_cuda(v) for v in kwargs.values()):
            self.machine.placed = True
            args = tuple(_host(a) if _is_cuda(a) else a for a in args)
            kwargs = {key: _host(v) if _is_cuda(v) else v for key, v in kwargs.items()}
        return func(*args, **kwargs)


class _Autocast(torch.autocast):
    """`torch.autocast("cuda", ...)` on the simulated machine: autocast of the host ops that stand for the GPU's."""

    def __init__(self, device_type, *args, **kwargs):
        super().__init__("cpu" if _is_cuda(device_type) else device_type, *args, **kwargs)


class _GradScaler(torch.amp.GradScaler):
    def __init__(self, device="cuda", *args, **kwargs):
        super().__init__("cpu" if _is_cuda(device) else device, *args, **kwargs)


_FLASH_OPS = ("_flash_attn_varlen_forward", "_flash_attn_varlen_backward")


def _aten_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                  *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
                  block_table=None, num_splits=None):  # fmt: skip
    machine = current_machine("aten::_flash_attention_forward", query, key, value)
    if cum_seq_q is None:
        raise NotImplementedError("the emulated _flash_attention_forward covers the varlen path (cum_seq_q given)")
    kernels.check_inputs(query, key, value, cum_seq_q, cum_seq_k, capability=machine.capability)
    if seqused_k is not None or alibi_slopes is not None or block_table is not None:
        raise NotImplementedError("the emulated _flash_attention_forward covers training: no KV cache, no alibi")
    left = -1 if window_size_left is None else int(window_size_left)
    right = -1 if window_size_right is None else int(window_size_right)
    seed = machine.next_seed() if dropout_p > 0 else 0
    out, lse = kernels.varlen_forward(
        query, key, value, cum_seq_q, cum_seq_k, scale=query.shape[-1] ** -0.5 if scale is None else scale,
        causal=bool(is_causal) and int(max_q) > 1, left=left, right=right, dropout_p=dropout_p, seed=seed,
        max_q=int(max_q), max_k=int(max_k),
    )  # fmt: skip
    rng = torch.tensor([seed, 0], dtype=torch.uint64)
    return out, lse, rng, torch.empty(0), torch.empty(0, dtype=query.dtype)


def _aten_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                   is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                   window_size_right=None):  # fmt: skip
    machine = current_machine("aten::_flash_attention_backward", query, key, value)
    kernels.check_inputs(query, key, value, cum_seq_q, cum_seq_k, capability=machine.capability, backward=True)
    left = -1 if window_size_left is None else int(window_size_left)
    right = -1 if window_size_right is None else int(window_size_right)
    seed = int(rng_state[0].to(torch.int64)) if rng_state.numel() else 0
    return kernels.varlen_backward(
        grad_out, query, key, value, cum_seq_q, cum_seq_k, scale=query.shape[-1] ** -0.5 if scale is None else scale,
        causal=bool(is_causal) and int(max_q) > 1, left=left, right=right, dropout_p=dropout_p, seed=seed,
        max_q=int(max_q), max_k=int(max_k),
    )  # fmt: skip


_ATEN_LIBRARY: torch.library.Library | None = None
_FLASH_REGISTERED = False


def _register_kernels() -> None:
    """The reference kernels under the CPU dispatch key, once per process; outside a machine they refuse (see
    `current_machine`) as the missing CPU kernels did, so the rest of the suite sees no difference."""
    global _ATEN_LIBRARY
    if _ATEN_LIBRARY is None:
        _ATEN_LIBRARY = torch.library.Library("aten", "IMPL")
        _ATEN_LIBRARY.impl("_flash_attention_forward", _aten_forward, "CPU")
        _ATEN_LIBRARY.impl("_flash_attention_backward", _aten_backward, "CPU")


def _register_flash_attn() -> None:
    """flash-attn's custom ops are registered for CUDA only; give the same Python bodies to the CPU key."""
    global _FLASH_REGISTERED
    if _FLASH_REGISTERED:
        return
    from flash_attn import flash_attn_interface as fa

    for name in _FLASH_OPS:
        op = getattr(fa, name)
        op.register_kernel("cpu", op._init_fn)
    _FLASH_REGISTERED = True


class SimulatedGPU(contextlib.AbstractContextManager):
    """A one-GPU machine (compute capability `capability`, `memory_gb` of device memory) for the duration of the
    block. `flash_attn`: whether the flash-attn package is installed on it."""

    def __init__(self, capability: tuple[int, int] = (9, 0), memory_gb: float = 80.0, flash_attn: bool = True):
        self.capability = capability
        self.memory = int(memory_gb * 2**30)
        self.flash_attn = flash_attn
        self.placed = False
        self.kernel_calls: dict[str, int] = {}
        self._seed = 0
        self._stack = contextlib.ExitStack()

    def next_seed(self) -> int:
        self._seed += 1
        return self._seed

    # -- torch.cuda, as a CPU build cannot answer it
    def _properties(self, device=None):
        return SimpleNamespace(
            name=self.name(), total_memory=self.memory, major=self.capability[0], minor=self.capability[1],
            multi_processor_count=132, is_integrated=False, gcnArchName="emulated",
        )  # fmt: skip

    def name(self, device=None) -> str:
        return "NVIDIA H100 80GB HBM3 (emulated)" if self.capability == (9, 0) else f"sm{self.capability} (emulated)"

    @staticmethod
    def _resident() -> int:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _cuda_api(self) -> dict:
        peak = lambda device=None: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # noqa: E731
        return {
            "is_available": lambda: True,
            "device_count": lambda: 1,
            "current_device": lambda: 0,
            "set_device": lambda device: None,
            "synchronize": lambda device=None: None,
            "empty_cache": lambda: None,
            "get_device_capability": lambda device=None: self.capability,
            "get_device_name": self.name,
            "get_device_properties": self._properties,
            "is_bf16_supported": lambda including_emulation=True: self.capability[0] >= 8,
            "memory_allocated": lambda device=None: self._resident(),
            "memory_reserved": lambda device=None: self._resident(),
            "max_memory_allocated": peak,
            "max_memory_reserved": peak,
            "reset_peak_memory_stats": lambda device=None: None,
            "mem_get_info": lambda device=None: (self.memory - self._resident(), self.memory),
            "memory_stats": lambda device=None: {"allocated_bytes.all.current": self._resident()},
            "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
            "set_rng_state": lambda state, device="cuda": None,
            "get_rng_state_all": lambda: [],
            "set_rng_state_all": lambda states: None,
            "manual_seed_all": lambda seed: None,
            "manual_seed": lambda seed: None,
        }

    def __enter__(self) -> SimulatedGPU:
        if _ACTIVE is not None:
            raise RuntimeError("a simulated GPU machine is already active")
        if self.flash_attn and not (FLASH_ATTN_SDIST / "flash_attn" / "flash_attn_interface.py").exists():
            raise RuntimeError(
                f"flash-attn's Python interface is not unpacked under {FLASH_ATTN_SDIST}: run `make emulated` (it "
                "takes the flash-attn sdist from PyPI, builds nothing)"
            )
        try:
            self._activate()
        except BaseException:
            self._stack.close()  # a machine that failed half-way leaves nothing patched
            raise
        return self

    def _activate(self) -> None:
        global _ACTIVE
        # bitsandbytes picks its backend as it is imported: on a machine that reports a GPU, its CUDA library, which
        # a CPU build of torch cannot load. Imported before the machine reports one, its CPU kernels run QLoRA's
        # 4-bit layers on the placed (host) tensors, as the CUDA kernels would on a GPU's.
        with contextlib.suppress(ImportError):
            import bitsandbytes  # noqa: F401
        enter = self._stack.enter_context
        patch = self._stack.enter_context
        for name, fn in self._cuda_api().items():
            patch(_patched(torch.cuda, name, fn))
        patch(_patched(torch, "autocast", _Autocast))
        patch(_patched(torch.amp, "autocast", _Autocast))
        patch(_patched(torch.amp, "GradScaler", _GradScaler))
        # DataLoader's pin-memory thread runs outside the placement mode (modes are per thread).
        patch(_patched(torch.Tensor, "pin_memory", lambda tensor, device=None: tensor))
        if self.flash_attn:
            patch(_on_sys_path(str(FLASH_ATTN_SDIST), str(STAND_IN)))
            patch(_kept_modules(("flash_attn", "flash_attn_2_cuda")))
        else:
            patch(_hidden_modules("flash_attn"))
        _register_kernels()
        _ACTIVE = self
        self._stack.callback(self._deactivate)
        if self.flash_attn:
            _register_flash_attn()
        enter(_Placement(self))
        _clear_product_caches()
        self._stack.callback(_clear_product_caches)

    @staticmethod
    def _deactivate() -> None:
        global _ACTIVE
        _ACTIVE = None

    def __exit__(self, *exc) -> None:
        self._stack.close()


def _clear_product_caches() -> None:
    """The product caches what it found installed; a machine with other packages must be asked again."""
    from lit_packing.models import backends, kernels

    kernels.flash_attn_status.cache_clear()
    backends._explain_auto.cache_clear()
    kernels._LOADED.clear()


@contextlib.contextmanager
def _patched(owner, name: str, value):
    missing = object()
    old = owner.__dict__.get(name, missing) if isinstance(owner, type) else getattr(owner, name, missing)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if old is missing:
            delattr(owner, name)
        else:
            setattr(owner, name, old)


@contextlib.contextmanager
def _on_sys_path(*folders: str):
    sys.path[:0] = folders
    try:
        yield
    finally:
        for folder in folders:
            sys.path.remove(folder)


_KEPT: dict = {}


@contextlib.contextmanager
def _kept_modules(prefixes: tuple[str, ...]):
    """flash-attn's modules exist on this machine only: taken out of `sys.modules` when it goes, put back when a
    machine comes again (importing them twice would register their custom ops twice)."""
    sys.modules.update(_KEPT)
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] in prefixes]:
            _KEPT[name] = sys.modules.pop(name)


@contextlib.contextmanager
def _hidden_modules(prefix: str):
    """A machine without a package: it cannot be imported inside the block (even if imported before)."""
    saved = {name: mod for name, mod in sys.modules.items() if name == prefix or name.startswith(prefix + ".")}
    for name in saved:
        del sys.modules[name]
    sys.modules[prefix] = None  # `import flash_attn` raises ImportError
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n == prefix or n.startswith(prefix + ".")]:
            del sys.modules[name]  # also what the block imported from elsewhere
        sys.modules.update(saved)
