"""One ggml thread pool for every llama.cpp context in the process.

Each llama.cpp context otherwise makes its own pool of worker threads, and a pool's threads
keep polling for work for a while after each pass. With a target and a draft context taking
turns on a machine with few cores, the idle pool's polling threads take the cores the busy
pool needs: on this project's 2-core machine passes that follow the other context's work
were seen to take several times longer. Our contexts never run at the same time (the engine
alternates draft and verify passes), so they can share one pool: its threads serve whichever
context runs, and nothing polls against it.

llama-cpp-python (0.3.36) does not bind ``ggml_threadpool_new`` or ``llama_attach_threadpool``,
so they are declared here over the shared libraries the binding ships; the struct mirrors
``ggml_threadpool_params`` in ggml.h. Where anything is missing, contexts keep their own pools
(the caller falls back silently: correctness does not depend on it).
"""

from __future__ import annotations

import ctypes
import functools
import os
from types import ModuleType

GGML_MAX_N_THREADS = 512  # ggml.h: the size of the cpumask array in ggml_threadpool_params


class ThreadpoolParams(ctypes.Structure):
    _fields_ = [
        ("cpumask", ctypes.c_bool * GGML_MAX_N_THREADS),  # all false: the default affinity
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),  # enum ggml_sched_priority
        ("poll", ctypes.c_uint32),  # 0: sleep between graphs; 100: poll aggressively
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


@functools.cache  # one pool per thread count, for the life of the process
def shared_threadpool(llama_cpp: ModuleType, n_threads: int) -> int | None:
    """The address of a ggml thread pool of ``n_threads`` threads, or None where the libraries
    do not export the functions."""
    libdir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    try:
        base = ctypes.CDLL(os.path.join(libdir, "libggml-base.so"))
        cpu = ctypes.CDLL(os.path.join(libdir, "libggml-cpu.so"))
        init, new = base.ggml_threadpool_params_init, cpu.ggml_threadpool_new
    except (OSError, AttributeError):
        return None
    init.argtypes, init.restype = [ctypes.POINTER(ThreadpoolParams), ctypes.c_int], None
    new.argtypes, new.restype = [ctypes.POINTER(ThreadpoolParams)], ctypes.c_void_p
    params = ThreadpoolParams()
    init(ctypes.byref(params), n_threads)
    return new(ctypes.byref(params)) or None


def attach_shared_threadpool(llama_cpp: ModuleType, context: object, n_threads: int) -> bool:
    """Make ``context`` run on the process's shared pool of ``n_threads`` threads (for single
    tokens and batches alike); False where that cannot be done and it keeps its own pool."""
    pool = shared_threadpool(llama_cpp, n_threads)
    attach = getattr(getattr(llama_cpp, "llama_cpp", None), "_lib", None)
    attach = getattr(attach, "llama_attach_threadpool", None)
    if pool is None or attach is None:
        return False
    attach.argtypes, attach.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p], None
    address = context if isinstance(context, int) else ctypes.cast(context, ctypes.c_void_p).value
    attach(ctypes.c_void_p(address), ctypes.c_void_p(pool), ctypes.c_void_p(pool))
    return True
