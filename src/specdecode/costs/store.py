"""Measured pass costs kept on disk, so that a one-shot run does not time them again.

Timing the passes that the cost-aware draft length, suffix decoding and the auto method read
takes seconds (the demo pair on llama.cpp: about 10 s of probes on 2 cores) for a generation
that may take less. A table is stored under a key of everything its timings depend on: the
model file's identity (name, size, modification time and a hash of its first and last MiB), the
backend and its settings (dtype, KV storage, compiled passes), the thread count, the CPU model,
the GPU and the library versions; a change in any of them is another key, so it is timed
afresh. ``retime_costs=True`` (``--retime-costs``) times again and overwrites the stored table.

A stored table is a prior, not a verdict (issue 50). The first read of each table checks it
(``costs/spot_check.py``: its costs in order, and this machine's one-row pass timed now within 2x
of the stored one); a table that fails is dropped, so its users time it afresh and store the new
figures. A timing whose repeats never agreed (``core/timing.py``) is used for the run but not
stored. The passes of a run correct the table as it runs and are written back to it, bounded
(``costs/live.py``). Each such event leaves one line in ``CostStore.notes`` for the user.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specdecode.backends.llamacpp import llama_cpp_version, use_extra_buffer_types
from specdecode.backends.llamacpp_sequence import LlamaCppSequence
from specdecode.backends.torch_backend import TorchSequence
from specdecode.core.device import cpu_model
from specdecode.core.paths import cache_dir
from specdecode.core.timing import Timing, best_seconds, is_settled
from specdecode.costs.spot_check import (
    SPOT_CHECK_REPEATS,
    contradicted_note,
    contradiction,
    not_stored_note,
    out_of_order,
    out_of_order_note,
    out_of_order_why,
    outliers,
)

if TYPE_CHECKING:
    from specdecode.backends.base import SequenceModel
    from specdecode.models.loader import LoadedModel

COST_STORE_SCHEMA = 1
VERIFY_TABLE = "verify"  # the target's pass over 1, 2, ... rows
DRAFT_TABLE = "draft"  # the draft model's one-row pass and its catch-up pass
IDENTITY_BYTES = 1 << 20  # hashed from each end of a model file: cheap, and catches a re-written file
SPOT_CHECK_ROWS = 1  # the pass a stored table is checked by: every table has it, and it is the cheapest
# Cached positions before the spot check's timed row. The tables were timed after 64
# (``COST_PROBE_CONTEXT``), but attention over 64 positions is a sliver of a one-row pass either
# way, while prefilling 64 tokens cost most of a check that did (1.4 of 1.7 s on the demo target,
# 2 cores); a 4-token prefill costs about two one-row passes.
SPOT_CHECK_CONTEXT = 4

# Seconds of the model's one-row pass on this machine now: what a stored table is checked against.
OneRowProbe = Callable[[], float]


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
    return CostStore(key, retime=retime, probe=one_row_probe(loaded, kv_dtype, compile_mode))


def one_row_probe(loaded: LoadedModel, kv_dtype: str, compile_mode: str | None) -> OneRowProbe | None:
    """Times ``loaded``'s one-row pass on a sequence of its own, as its stored tables were timed
    (after a warm-up); None for compiled passes, which an eager pass would misprice and whose own
    shape would cost a compile to time."""
    if compile_mode is not None:
        return None
    model = loaded.model
    if loaded.backend == "llama.cpp":
        # On a scratch context over the same weights, closed after: the check runs at every load,
        # and the model's own context is made only when a request decodes in it (a server's
        # never does). llama.cpp attends over the cells in use, so the pass costs the same.
        return lambda: time_scratch_row(model)
    return lambda: time_one_row(TorchSequence(model, kv_dtype))


def time_scratch_row(model: Any) -> Timing:  # model: a LlamaCppModel
    """``time_one_row`` on a one-sequence context of its own over ``model``'s weights."""
    scratch = model.with_sequences(1, SPOT_CHECK_CONTEXT + SPOT_CHECK_ROWS)
    try:
        return time_one_row(LlamaCppSequence(scratch))
    finally:
        scratch.close()


def time_one_row(sequence: SequenceModel) -> Timing:
    """Seconds of ``sequence``'s one-row pass after ``SPOT_CHECK_CONTEXT`` cached positions
    (best of ``SPOT_CHECK_REPEATS``, after a warm-up), through the backend protocol."""
    context = torch.zeros((1, SPOT_CHECK_CONTEXT), dtype=torch.long, device=sequence.device)
    sequence.begin(SPOT_CHECK_CONTEXT + SPOT_CHECK_ROWS)
    sequence.extend(context, 0, compute_logits=False)
    sequence.commit(SPOT_CHECK_CONTEXT)
    row = context[:, :SPOT_CHECK_ROWS]
    # Each pass writes past the valid length, which the next overwrites, as a verify pass does.
    seconds = best_seconds(lambda: sequence.extend(row, SPOT_CHECK_CONTEXT, logits_last=1), sequence.device,
                           SPOT_CHECK_REPEATS)
    sequence.commit(0)  # frees llama.cpp's cells for the sequence the engine begins next
    return seconds


class CostStore:
    """One model's stored pass-cost tables (by name, e.g. "verify" and "draft") under one key.

    ``probe`` times the model's one-row pass now, to check a stored table before it is trusted
    (None: trusted as stored). ``notes`` collects one line per event the user should hear of: a
    stored table re-timed, fresh timings not stored (``take_notes`` reads each once).
    """

    def __init__(self, key: dict[str, Any], retime: bool = False, probe: OneRowProbe | None = None) -> None:
        self.key = {"schema": COST_STORE_SCHEMA, **key}
        self.retime = retime
        self.probe = probe
        self.role = str(key.get("role", "model"))
        name = hashlib.sha256(json.dumps(self.key, sort_keys=True, default=str).encode()).hexdigest()[:24]
        self.path = cache_dir() / "costs" / f"{name}.json"
        self._tables: dict[str, dict[str, float]] | None = None
        self._checked: set[str] = set()  # tables checked against the machine in this run
        self._one_row_now: float | None = None  # the probe's figure, timed once per store
        self._left_out: dict[str, set[int]] = {}  # row counts put but not stored (and noted), by table
        self.notes: list[str] = []

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
        """The stored table ``name`` (row count -> seconds), empty where none is stored or where
        the machine contradicts it (then dropped: its users time it afresh and ``put`` it)."""
        if name not in self._checked:
            self._checked.add(name)
            self._check(name)
        return self.stored(name)

    def stored(self, name: str) -> dict[int, float]:
        """Table ``name`` as it is stored now, unchecked (what a live write-back starts from)."""
        return {int(rows): float(seconds) for rows, seconds in self._load().get(name, {}).items()}

    def _check(self, name: str) -> None:
        """Drop stored table ``name`` where its costs are out of order or the probe's one-row
        pass contradicts its own by more than ``CONTRADICTION_FACTOR``, with a note saying so."""
        table = self.stored(name)
        if not table:
            return
        pair = out_of_order(table)
        if pair is not None:
            self._drop(name, out_of_order_note(self.role, *pair, table))
            return
        if self.probe is None or SPOT_CHECK_ROWS not in table:
            return
        if self._one_row_now is None:
            try:
                self._one_row_now = self.probe()
            except Exception:  # noqa: BLE001 - a check that cannot run leaves the stored table as it was
                return
        stored, now = table[SPOT_CHECK_ROWS], self._one_row_now
        factor = contradiction(stored, now)
        if factor is not None:
            self._drop(name, contradicted_note(self.role, factor, stored, now))

    def _drop(self, name: str, note: str) -> None:
        self._load().pop(name, None)
        self._write()  # so that a contradicted table is not read again, whether or not it is re-timed
        self.notes.append(note)

    def put(self, name: str, table: dict[int, float]) -> None:
        """Store table ``name`` (merged over what is stored; written atomically). Timings whose
        repeats never settled, or that are out of order with the rest, are left out: this run
        uses them, the next one times them again."""
        tables = self._load()
        # A caller puts its whole table each time it times more rows: say once what is left out.
        noted = self._left_out.setdefault(name, set())
        unsettled = sorted(rows for rows, seconds in table.items() if not is_settled(seconds))
        merged = {int(rows): seconds for rows, seconds in tables.get(name, {}).items()}
        merged.update((rows, float(seconds)) for rows, seconds in table.items())
        if set(unsettled) - noted:
            spread = max(getattr(table[rows], "spread", 1.0) for rows in unsettled)
            self.notes.append(not_stored_note(self.role, unsettled, f"repeats {spread:.1f}x apart"))
        for rows in unsettled:
            merged.pop(rows)
        pair = out_of_order(merged)
        dropped = outliers(merged)
        if pair is not None and set(dropped) - noted:
            self.notes.append(not_stored_note(self.role, dropped, out_of_order_why(*pair, merged)))
        for rows in dropped:
            merged.pop(rows)
        noted.update(unsettled, dropped)
        tables[name] = {str(rows): seconds for rows, seconds in sorted(merged.items())}
        self._write()

    def _write(self) -> None:
        tables = self._load()
        with contextlib.suppress(OSError):  # a read-only cache only costs the next run its timing
            self.path.parent.mkdir(parents=True, exist_ok=True)
            scratch = self.path.with_suffix(f".{os.getpid()}.tmp")
            scratch.write_text(json.dumps({"key": self.key, "tables": tables}, indent=1, default=str) + "\n")
            scratch.replace(self.path)

    def take_notes(self) -> list[str]:
        """The notes not yet read, once each (a decoder shows them with the next request)."""
        notes, self.notes = self.notes, []
        return notes
