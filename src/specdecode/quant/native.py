"""A small native int8 matmul for decode-sized inputs, compiled on first use.

Why it exists: weight-only int8 halves the bytes a forward pass reads, but the kernel must
also stay cheap for the few rows a verify pass feeds (k + 1). Measured on the 2-core AVX-512
CPU, the 1.5B demo target's 113 projections, weights cycled so they stream from memory, ms per
forward pass's matmuls, interleaved, median of 5
(``python benchmarks/bench_quant_kernels.py --rows 1,2,4,6,8 --repeats 5``):

    rows                                  1      2      4      6      8
    bf16 oneDNN (packed)                128    143    149    164    222
    torch _weight_int8pack_mm           101    111    127    241    262
    this kernel, fp32 activations       100    112    124    141    176
    this kernel, int16-block activations 61     65     75     84    128
    torch int4 (group 32), for scale     50     60     84    163    179

torch's int8 kernel is fine for one row but costs 2.4x at six; this one converts each weight
vector once for every row, and its default path (VNNI, see ``int8_gemm.cpp``) rounds each
128-input block of activations to int16 and prefetches the weight stream: at one row it reads
1.55 GB in 61 ms, 25 GB/s.

The library is built with the system C++ compiler (``$CXX``, else ``g++``) into the cache
directory, keyed by the source and the CPU's flags. Any failure (no compiler, no AVX-512,
``SPECDECODE_NATIVE=0``) leaves ``int8_gemm`` unavailable and callers use torch's kernel; the
reason is kept in ``unavailable_reason()``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from specdecode.core.device import cpuinfo_line
from specdecode.core.paths import cache_dir

MAX_ROWS = 8  # the kernel's compiled row counts; callers split larger inputs
ACTIVATION_BLOCK = 128  # XBLOCK in the C++ source
# The VNNI path (see int8_gemm.cpp) rounds activations to int16 per 128-input block; setting
# SPECDECODE_INT8_FP32_ACTIVATIONS=1 keeps them in fp32 (slower, for comparisons).
BLOCKED_INT16_ACTIVATIONS = os.environ.get("SPECDECODE_INT8_FP32_ACTIVATIONS", "0") != "1"
DISABLE_ENV_VAR = "SPECDECODE_NATIVE"
_SOURCE = Path(__file__).with_name("int8_gemm.cpp")
# -ffp-contract=off: the per-output epilogue (scale, then bias) must round the same way for every
# row count; left to the compiler, some unrolled row counts fuse it into one FMA and others do not,
# so a verify pass and a one-row pass of the same input would differ in the last bit.
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_BUILD_TIMEOUT_S = 180

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None
_tried = False


def _cpu_signature() -> str:
    return cpuinfo_line("flags") or platform.processor() or platform.machine()


def _build(target: Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set $CXX or install g++)")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        proc = subprocess.run(
            [compiler, *_FLAGS, str(_SOURCE), "-o", str(built)],
            capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {_SOURCE.name} failed: {proc.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: a concurrent process sees the old file or the new one


def _load() -> ctypes.CDLL | None:
    global _library, _failure, _tried
    if _tried:  # every quantized layer asks on every call: no lock once settled
        return _library
    with _lock:
        if _tried:
            return _library
        _tried = True
        if os.environ.get(DISABLE_ENV_VAR, "1") == "0":
            _failure = f"disabled by {DISABLE_ENV_VAR}=0"
            return None
        key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + _cpu_signature().encode()).hexdigest()[:16]
        folder = cache_dir() / "kernels"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"int8_gemm-{key}.so"
        try:
            if not path.exists():
                _build(path)
            library = ctypes.CDLL(str(path))
            fn = library.specdecode_int8_gemm
            fn.restype = ctypes.c_int
            fn.argtypes = [
                ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
            ]
        except (OSError, RuntimeError, subprocess.TimeoutExpired, AttributeError) as err:
            _failure = str(err)
            return None
        _library = library
        return library


def available() -> bool:
    """True when the native kernel is built and loadable here (builds it on first call)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _failure


def int8_gemm(
    x: torch.Tensor,  # (M, K) bf16 or fp32, contiguous, CPU; 1 <= M <= MAX_ROWS
    weight: torch.Tensor,  # (N, K) int8, contiguous
    scales: torch.Tensor,  # (N,) fp32
    bias: torch.Tensor | None,  # (N,) fp32
) -> torch.Tensor:  # (M, N) in x's dtype
    library = _load()
    if library is None:
        raise RuntimeError(f"the native int8 kernel is unavailable: {_failure}")
    rows, in_features = x.shape
    out = torch.empty(rows, weight.shape[0], dtype=x.dtype)
    scratch = torch.empty(rows * in_features, dtype=torch.float32) if x.dtype == torch.bfloat16 else out
    x_int16 = None
    if BLOCKED_INT16_ACTIVATIONS and in_features % ACTIVATION_BLOCK == 0:
        # int16 values, then one fp32 scale (two int16 slots) per block of each row.
        x_int16 = torch.empty(rows * in_features + 2 * rows * (in_features // ACTIVATION_BLOCK), dtype=torch.int16)
    status = library.specdecode_int8_gemm(
        x.data_ptr(), int(x.dtype == torch.bfloat16), rows, in_features, weight.data_ptr(), weight.shape[0],
        scales.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), scratch.data_ptr(),
        None if x_int16 is None else x_int16.data_ptr(), torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"int8_gemm takes 1 to {MAX_ROWS} rows, got {rows}")
    return out
