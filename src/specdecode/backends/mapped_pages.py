"""Give back the pages of a GGUF file's mapping that the process no longer reads.

llama.cpp maps a GGUF file (``LLAMA_LOAD_MODE_MMAP``) and, where it repacks weights for the CPU
(the ``CPU_REPACK`` buffer type: AVX2/AVX-512 layouts), copies those tensors into buffers of its
own while loading. The copy reads every page of them through the mapping, and the loader unmaps
only the file's head and tail, so the originals stay resident for the life of the model: on the
demo target 1,085 MB of file pages resident beside 596 MiB of repacked copies, though only the
tensors it did not repack (463 MiB) are ever read again (llama-server keeps them the same way).

``drop_resident_pages`` tells the kernel (``madvise(MADV_DONTNEED)``) that the whole mapping is
not needed now. A file mapping loses nothing by it: a page read later faults back in from the
page cache (or the file), so the tensors still read from the mapping come back on the first
pass, and the repacked ones' originals stay out. Linux only; elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

MADV_DONTNEED = 4  # <sys/mman.h> on Linux


def file_mappings(path: Path, maps: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """(start, end) addresses of this process's mappings of ``path``."""
    target = os.path.realpath(path)
    ranges = []
    with open(maps, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and os.path.realpath(fields[5].strip()) == target:
                start, end = (int(part, 16) for part in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def drop_resident_pages(path: Path) -> int:
    """Drop this process's resident pages of ``path``'s mappings (the module docstring); the
    bytes of address space advised. 0 where the platform has no /proc maps or madvise, or
    where the call fails (nothing changes then: it is only a hint)."""
    if not sys.platform.startswith("linux") or not os.path.exists("/proc/self/maps"):
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    advised = 0
    for start, end in file_mappings(path):
        if libc.madvise(start, end - start, MADV_DONTNEED) == 0:
            advised += end - start
    return advised
