"""Measured pass costs kept on disk, so that a one-shot run does not time them again.

Timing the passes that the cost-aware draft length, suffix decoding and the auto method read
takes seconds (the demo pair on llama.cpp: about 10 s of probes on 2 cores) for a generation
that may take less. A table is stored under a key of everything its timings depend on: the
model file's identity (name, size, modification time and a hash of its first and last MiB), the
backend and its settings (dtype, KV storage, compiled passes), the thread count, the CPU model,
the GPU and the library versions; a change in any of them is another key, so it is timed
afresh. ``retime_costs=True`` (``--retime-costs``) times again and overwrites the stored table.
Live step timings still refine the loaded table within a run, as they refine a measured one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specdecode.backends.device import cpu_model
from specdecode.backends.llamacpp import llama_cpp_version, use_extra_buffer_types
from specdecode.models.paths import cache_dir

if TYPE_CHECKING:
    from specdecode.models.loader import LoadedModel

COST_STORE_SCHEMA = 1
VERIFY_TABLE = "verify"  # the target's pass over 1, 2, ... rows
DRAFT_TABLE = "draft"  # the draft model's one-row pass and its catch-up pass
IDENTITY_BYTES = 1 << 20  # hashed from each end of a model file: cheap, and catches a re-written file


def file_identity(path: Path) -> dict[str, Any]:
    stat = path.stat()
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        digest.update(handle.read(IDENTITY_BYTES))
        if stat.st_size > 2 * IDENTITY_BYTES:
            handle.seek(-IDENTITY_BYTES, os.SEEK_END)
            digest.update(handle.read(IDENTITY_BYTES))
    return {"name": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256_ends": digest.hexdigest()}


def model_identity(path: Path) -> list[dict[str, Any]]:
    """A GGUF file's identity, or a model folder's (its config and weight files)."""
    if path.is_file():
        return [file_identity(path)]
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".gguf", ".bin") or p.name == "config.json")
    return [file_identity(p) for p in files]


def cost_store_for(loaded: LoadedModel, role: str, kv_dtype: str, compile_mode: str | None,
                   retime: bool = False) -> CostStore | None:
    """Where ``loaded``'s measured pass costs (as ``role``, "target" or "draft") are kept between
    runs, keyed by everything they depend on; None where the model has no file to identify it by."""
    model = loaded.model
    llamacpp = loaded.backend == "llama.cpp"
    try:
        identity = model_identity(Path(model.path if llamacpp else loaded.folder))
    except (OSError, AttributeError, TypeError):
        return None
    device = torch.device("cpu") if llamacpp else model.device
    key = {
        "role": role, "backend": loaded.backend, "model": identity, "quant": loaded.quant, "cpu": cpu_model(),
        "kv_dtype": kv_dtype, "compile": compile_mode, "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    if llamacpp:
        key.update(threads=model.n_threads, kv_type=model.kv_type, flash_attn=model.flash_attn,
                   repack=use_extra_buffer_types(), llama_cpp=llama_cpp_version())
    else:
        key.update(threads=torch.get_num_threads(), dtype=str(model.dtype))
    return CostStore(key, retime=retime)


class CostStore:
    """One model's stored pass-cost tables (by name, e.g. "verify" and "draft") under one key."""

    def __init__(self, key: dict[str, Any], retime: bool = False) -> None:
        self.key = {"schema": COST_STORE_SCHEMA, **key}
        self.retime = retime
        name = hashlib.sha256(json.dumps(self.key, sort_keys=True, default=str).encode()).hexdigest()[:24]
        self.path = cache_dir() / "costs" / f"{name}.json"
        self._tables: dict[str, dict[str, float]] | None = None

    def _load(self) -> dict[str, dict[str, float]]:
        if self._tables is None:
            self._tables = {}
            if not self.retime:
                with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                    data = json.loads(self.path.read_text())
                    if data.get("key") == json.loads(json.dumps(self.key, default=str)):
                        self._tables = {name: dict(table) for name, table in data["tables"].items()}
        return self._tables

    def get(self, name: str) -> dict[int, float]:
        """The stored table ``name`` (row count -> seconds), empty where none is stored."""
        return {int(rows): float(seconds) for rows, seconds in self._load().get(name, {}).items()}

    def put(self, name: str, table: dict[int, float]) -> None:
        """Store table ``name`` (merged over what is stored; written atomically)."""
        tables = self._load()
        tables[name] = {**tables.get(name, {}), **{str(rows): seconds for rows, seconds in table.items()}}
        with contextlib.suppress(OSError):  # a read-only cache only costs the next run its timing
            self.path.parent.mkdir(parents=True, exist_ok=True)
            scratch = self.path.with_suffix(f".{os.getpid()}.tmp")
            scratch.write_text(json.dumps({"key": self.key, "tables": tables}, indent=1, default=str) + "\n")
            scratch.replace(self.path)
