"""Device and dtype selection."""

from __future__ import annotations

import os
import platform
from functools import cache

import torch

from specdecode.errors import InvalidRequestError

DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")  # or "cuda:N"
DEVICE_CHOICES = DEVICES
DTYPE_CHOICES = {"auto": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name not in DEVICE_CHOICES and not name.startswith("cuda:"):
        raise InvalidRequestError(f"device={name!r} is not one of: {', '.join(DEVICE_CHOICES)}.")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequestError('device="cuda" was asked for, but PyTorch sees no CUDA device.')
    return torch.device(name)


def cpu_supports_bf16() -> bool:
    """True when oneDNN has native bf16 kernels here (AVX-512 BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 where the hardware computes in it natively, else fp32."""
    if name not in DTYPE_CHOICES:
        raise InvalidRequestError(f"dtype={name!r} is not one of: {', '.join(DTYPE_CHOICES)}.")
    chosen = DTYPE_CHOICES[name]
    if chosen is not None:
        return chosen
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_supports_bf16() else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))


def host_to_device(values: list | tuple, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of host ``values`` on ``device`` without stalling the host.

    A copy from ordinary (pageable) host memory to a GPU waits until every queued kernel has
    run: a full sync in the middle of a decode step. Staged through pinned memory the copy is
    queued behind those kernels instead (PyTorch's pinned-memory cache keeps the buffer alive
    until the copy is done). On the CPU this is ``torch.tensor``.
    """
    tensor = torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


@cache
def cpuinfo_line(field: str) -> str | None:
    """The first line of /proc/cpuinfo whose name is ``field`` ("model name", "flags"), or None
    where there is no such file or line (read once per process: it does not change)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.rstrip("\n") for line in cpuinfo if line.split(":", 1)[0].strip() == field), None)
    except OSError:
        return None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or what ``platform`` knows where there is none."""
    line = cpuinfo_line("model name")
    return line.split(":", 1)[1].strip() if line else platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo: avx512f, amx_tile, ...); empty where unknown."""
    line = cpuinfo_line("flags")
    return frozenset(line.split(":", 1)[1].split()) if line else frozenset()


def resident_bytes(pid: int | str = "self") -> int | None:
    """A process's resident set size (Linux's /proc/PID/statm; this process by default), or None
    where it cannot be read (another OS, a process that has ended)."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
