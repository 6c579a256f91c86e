"""llama-cpp-python's binding, set up once per process: importing it (with an error that says
how to install it), llama.cpp's log (swallowed, its recent warnings kept for our errors), the
errors a llama.cpp model raises, and the thread count it defaults to.

``llama_cpp`` is imported on first use, so this module imports without the binding.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
from collections import deque
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from specdecode.errors import InvalidRequestError, SpecDecodeError

# ggml's log levels (ggml.h). llama-cpp-python's own _logger maps an older numbering.
GGML_LOG_LEVEL_WARN = 3
GGML_LOG_LEVEL_CONT = 5
# llama_decode return codes (llama.h).
DECODE_OK = 0
DECODE_NO_KV_SLOT = 1
DECODE_ABORTED = 2
DECODE_INVALID_BATCH = -1
RECENT_LOG_LINES = 20  # warnings/errors kept to explain a failed load or decode


class BackendUnavailableError(SpecDecodeError):
    """The llama.cpp backend was asked for but llama-cpp-python is not installed."""


class ContextOverflowError(InvalidRequestError):
    """A pass would write positions beyond the context the model was created with."""


class LlamaCppDecodeError(SpecDecodeError):
    """llama_decode refused or failed a batch."""


def import_llama_cpp() -> ModuleType:
    try:
        import llama_cpp
    except ImportError as err:  # a missing or unloadable libllama also surfaces as ImportError
        raise BackendUnavailableError(
            "the llama.cpp backend needs llama-cpp-python: `pip install llama-cpp-python` (it compiles "
            f"llama.cpp, so it needs a C++ compiler and CMake), or use the torch backend instead ({err})"
        ) from err
    _set_up_once(llama_cpp)
    return llama_cpp


@functools.cache  # the log callback and the backend are process-global: set them up once
def _set_up_once(llama_cpp: ModuleType) -> None:
    LogSink.install(llama_cpp)
    llama_cpp.llama_backend_init()


class LogSink:
    """Swallows llama.cpp's log output, keeping recent warnings and errors for our exceptions.

    llama.cpp's logger is process-global, so there is one sink; importing llama_cpp installs
    a callback that prints everything to stderr, which this one replaces.
    """

    recent: ClassVar[deque[str]] = deque(maxlen=RECENT_LOG_LINES)
    echo: ClassVar[bool] = False  # also print every line to stderr (LlamaCppModel(verbose=True))
    _callback: ClassVar[Any] = None  # the ctypes callback, held here so it is never garbage-collected
    _last_level: ClassVar[int] = 0

    @classmethod
    def install(cls, llama_cpp: ModuleType) -> None:
        cls._callback = llama_cpp.llama_log_callback(cls._log)
        llama_cpp.llama_log_set(cls._callback, ctypes.c_void_p(0))

    @classmethod
    def _log(cls, level: int, text: bytes | None, user_data: int | None) -> None:
        # Never raise: an exception in a ctypes callback cannot reach anyone who could handle it.
        with contextlib.suppress(Exception):
            message = text.decode("utf-8", errors="replace") if text else ""
            if level != GGML_LOG_LEVEL_CONT:  # a continuation keeps its first part's level
                cls._last_level = level
            if cls._last_level >= GGML_LOG_LEVEL_WARN:
                cls.recent.append(message.rstrip("\n"))
            if cls.echo:
                print(message, end="", file=sys.stderr, flush=True)

    @classmethod
    def take_recent(cls) -> str:
        """The last few warnings and errors, joined; forgets them."""
        lines = [line for line in cls.recent if line.strip()]
        cls.recent.clear()
        return "; ".join(lines[-5:])


def decode_error(rc: int, count: int) -> LlamaCppDecodeError:
    """The error for llama_decode's return code ``rc`` on a batch of ``count`` tokens."""
    detail = LogSink.take_recent()
    detail = f" (llama.cpp: {detail})" if detail else ""
    if rc == DECODE_NO_KV_SLOT:
        return LlamaCppDecodeError(
            f"the llama.cpp context is full: no KV cache room for {count} more tokens{detail}; "
            "truncate or clear sequences, or create the model with a larger n_ctx"
        )
    if rc == DECODE_ABORTED:
        return LlamaCppDecodeError(f"llama_decode was aborted{detail}")
    if rc == DECODE_INVALID_BATCH:
        return LlamaCppDecodeError(f"llama.cpp rejected the batch as invalid{detail}")
    return LlamaCppDecodeError(f"llama_decode failed with code {rc}{detail}")


def physical_core_count() -> int:
    """Physical cores among the CPUs this process may run on.

    llama.cpp's matrix kernels gain nothing from a core's second hyperthread and lose when
    threads outnumber the cores they get, so we count (package, core) pairs over the affinity
    mask rather than logical CPUs; where the topology is unreadable, the number of allowed CPUs.
    """
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
    cores: set[tuple[str, str]] = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topology / "physical_package_id").read_text().strip()
            cores.add((package, (topology / "core_id").read_text().strip()))
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))
