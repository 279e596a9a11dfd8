"""What float rounding does to a forward: the setting a forward runs under (:func:`forward_context`: device, dtype,
torch version, threads), the unit roundoff of its arithmetic there (:func:`unit_roundoff`), kernels that give the
same bits on every run (:func:`reproducible_kernels`), and a forward whose every layer is moved by that much
(:func:`rounding_noise`): how far its values move then is the model's own rounding noise, the tolerance within
which :mod:`extractor.store.forward` takes forwards made in other settings as one.
"""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["forward_context", "reproducible_kernels", "rounding_noise", "unit_roundoff"]

_HALF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}  # autocast's compute dtypes: half an ulp of 1
_TF32 = 2.0 ** -11  # TF32's 10-bit mantissa (cuDNN's convolutions by default on Ampere and later)
_FLOAT32 = 2.0 ** -24


def unit_roundoff(device: torch.device, dtype: str) -> float:
    """The relative rounding of the forward's arithmetic: the autocast dtype's (``model.dtype``), TF32's where CUDA
    may use it (``torch.backends.cudnn.allow_tf32``, on by default, or a float32 matmul precision below highest),
    else float32's."""
    if dtype in _HALF:
        return _HALF[dtype]
    precision = torch.get_float32_matmul_precision()
    if precision == "medium":  # bfloat16 matmuls allowed
        return _HALF["bfloat16"]
    tf32 = torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32 or precision == "high"
    return _TF32 if device.type == "cuda" and tf32 else _FLOAT32


def forward_context(device: torch.device, dtype: str) -> dict[str, Any]:
    """What decides the bits of a forward besides the model and its input: the torch build, the device (a GPU's
    name and its libraries; a CPU's name, instruction set and thread count) and the compute dtype. Two forwards of
    one model and input in one context give the same bits (where :func:`reproducible_kernels` holds)."""
    context: dict[str, Any] = {"torch": torch.__version__, "device": device.type, "dtype": dtype,
                               "rounding": unit_roundoff(device, dtype),
                               "float32_matmul_precision": torch.get_float32_matmul_precision()}
    if device.type == "cuda":
        context.update(name=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                       cudnn=torch.backends.cudnn.version(),
                       tf32=[torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32])
    elif device.type == "cpu":
        context.update(name=_cpu_name(), isa=torch.backends.cpu.get_cpu_capability(), threads=torch.get_num_threads())
    return context


def _cpu_name() -> str:
    """The CPU's model name (kernels are chosen by it: MKL's and oneDNN's paths differ between makers)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@contextlib.contextmanager
def reproducible_kernels(device: torch.device) -> Iterator[None]:
    """For the block, cuDNN chooses its kernels by rule, not by timing them (``cudnn.benchmark``, which the worker
    sets, may choose others in another process): one model, input and context give the same bits every run."""
    if device.type != "cuda":
        yield
        return
    cudnn = torch.backends.cudnn
    was = cudnn.benchmark, cudnn.deterministic
    cudnn.benchmark, cudnn.deterministic = False, True
    try:
        yield
    finally:
        cudnn.benchmark, cudnn.deterministic = was


@contextlib.contextmanager
def rounding_noise(model: nn.Module, u: float, seed: int = 1) -> Iterator[None]:
    """For the block, every leaf module's floating-point inputs and outputs are multiplied by ``1 + u * r``, ``r``
    uniform in [-1, 1] and seeded: the forward that arithmetic rounding otherwise at every layer (another device,
    kernel or thread count) would give. The hooks go at the block's end, also when the forward raised."""
    generators: dict[torch.device, torch.Generator] = {}

    def moved(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            g = generators.get(x.device)
            if g is None:
                g = generators[x.device] = torch.Generator(x.device).manual_seed(seed)
            scale = torch.rand(x.shape, generator=g, device=x.device).mul_(2 * u).add_(1 - u)  # 1 + u * [-1, 1)
            return (x.to(torch.promote_types(x.dtype, torch.float32)) * scale).to(x.dtype)
        if type(x) in (tuple, list):  # plain ones only: a named tuple or a library's output stays as it is
            return type(x)(moved(v) for v in x)
        return x

    with contextlib.ExitStack() as stack:
        for module in model.modules():
            if next(module.children(), None) is None:
                stack.enter_context(module.register_forward_pre_hook(lambda _m, args: moved(args)))
                stack.enter_context(module.register_forward_hook(lambda _m, _args, out: moved(out)))
        yield
