"""backends/mapped_pages.py: a file mapping's resident pages are given back, and what the mapping
reads afterwards is still the file's (a page faults back in)."""

import mmap
import re
import sys
from pathlib import Path

import pytest

from specdecode.backends.mapped_pages import drop_resident_pages, file_mappings

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc maps: Linux")


def resident_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_resident_pages_are_dropped_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    data = bytes(range(256)) * (4 * 1024 * 16)  # 16 MiB
    path.write_bytes(data)
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        assert sum(mapped[i + 1] for i in range(0, len(data), 4096)) > 0  # every page touched
        assert len(file_mappings(path)) == 1
        before = resident_kib(path)
        assert before >= 15 * 1024
        assert drop_resident_pages(path) == len(data)
        assert resident_kib(path) < before // 4
        assert mapped[:] == data  # the file's bytes, faulted back in
        assert resident_kib(path) >= 15 * 1024


def test_a_file_not_mapped_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "other.bin"
    path.write_bytes(b"x" * 4096)
    assert file_mappings(path) == [] and drop_resident_pages(path) == 0
