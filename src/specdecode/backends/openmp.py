"""Releasing a thread's OpenMP team when it stops decoding, so another thread's passes keep full speed.

llama-cpp-python's wheels build ggml with OpenMP, and torch's CPU kernels use OpenMP too (one
libgomp in the process: the library is loaded once by its name). libgomp keeps a team of helper
threads for every thread that has run a parallel region, for as long as that thread lives, and
once its teams hold more threads than the process has cores it throttles the spinning at its
barriers to almost nothing: each of the hundreds of barriers in a ggml pass then sleeps and
wakes in the kernel. So a second thread that decodes, after the first has (the server's batch
worker after the main thread's warm-up; a caller's thread after the main thread sampled once),
ran every pass about 30% slower on two cores, and so did the first thread afterwards.

Running every pass on one dedicated thread does not help: torch's sampling over a 151k
vocabulary runs parallel regions in the caller's thread, which then holds a team of its own. So
a thread that ends a burst of decoding releases its team (``omp_pause_resource_all``, OpenMP
5.0: libgomp frees the calling thread's pool only); the next parallel region makes a new one,
which costs a thread start (tens of microseconds). Callers: the end of a single-sequence request
(``SpecDecoder.stream``) and of every other ``SpecDecoder`` call that runs passes
(``releases_thread_team``: the server's start-up warm-up and timing among them), the batch
worker when its engine goes idle. Where no libgomp is loaded, or it predates OpenMP 5.0, this does nothing.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

OMP_PAUSE_SOFT = 1  # omp.h: omp_pause_soft (free the threads, keep what is cheap to keep)


@functools.cache
def _pause_functions() -> tuple[object, ...]:
    """``omp_pause_resource_all`` of every libgomp the process has loaded (usually one)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux
        return ()
    paths = sorted({line.split()[-1] for line in maps.splitlines() if "libgomp" in line.rsplit("/", 1)[-1]})
    functions = []
    for path in paths:
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        functions.append(pause)
    return tuple(functions)


def release_thread_team() -> None:
    """Free the calling thread's OpenMP helper threads (a no-op inside a parallel region or where
    libgomp is absent). Call it when the thread stops decoding for a while."""
    for pause in _pause_functions():
        pause(OMP_PAUSE_SOFT)


def forget_loaded_libraries() -> None:
    """Look for libgomp again on the next release (after a library that loads it was imported)."""
    _pause_functions.cache_clear()


def releases_thread_team(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate a call that runs passes: the calling thread's OpenMP team is released after it."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        finally:
            release_thread_team()

    return wrapper
