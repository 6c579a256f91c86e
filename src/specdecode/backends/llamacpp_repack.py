"""Which of llama.cpp's extra (repacked) weight buffers our GGUF models load with.

ggml's CPU backend offers extra buffer types that hold weights in the layout its fastest
kernels read: ``AMX`` (Intel AMX tiles, where the build and the CPU have them), then
``CPU_REPACK`` (rows interleaved for the AVX2/AVX-512 kernels, ggml-cpu's ``repack.cpp``).
llama.cpp puts each weight in the first of them that takes it, else in the plain CPU buffer;
``llama_model_params.use_extra_bufts`` turns all of them on or off together.

On some Intel VMs AMX faults: with llama-cpp-python 0.3.36's ggml, a 2-core Xeon (amx_tile,
amx_int8) died with SIGILL on ``tilezero`` in the first multi-row pass. Turning every extra
buffer off there, as we did, also threw away the AVX-512 repack: a 4-row pass cost 2.2 one-row
passes instead of 1.2 (issue 50). So ``repack_choice`` decides, in this order:

1. ``SPECDECODE_LLAMACPP_REPACK=1`` or ``0`` forces them all on or off; nothing is probed.
2. A CPU without ``amx_tile`` among its flags, or a llama.cpp build without the AMX buffer
   type: all on.
3. A verdict stored by an earlier probe on this machine: beside the cost tables
   (``$SPECDECODE_CACHE/costs/repack-<key>.json``), keyed by the CPU model, its flags and
   llama-cpp-python's version (not by the model file), so the probe runs once per machine.
4. The probe, at the first load: a child process loads the GGUF with every extra buffer and
   runs a 2-row and a 4-row pass. Passed: all on, AMX included. Died by a signal (SIGILL, or
   any crash): a second child tries again without AMX; if that passes, weights are repacked
   without AMX, else the extra buffers are off. A probe of a model that puts no weight in an
   AMX buffer proves nothing about AMX, so it decides only that model's loads in this process;
   so does a child that fails without crashing (it could not load the file, timed out).

How AMX is left out: at each model load llama.cpp reads the CPU backend's list of extra buffer
types (``ggml_backend_dev_get_extra_bufts``: a null-terminated array that ggml keeps for the
life of the process). ``extra_buffers_without`` rewrites that array without the ``AMX`` entry
for the length of our load, then puts it back. llama-cpp-python 0.3.36 has nothing finer:
``use_extra_bufts`` is all or nothing, ggml reads no environment variable about AMX, and a
``tensor_buft_overrides`` entry that sends every tensor to ``CPU_REPACK`` crashes the load
(SIGSEGV, measured: the repack buffer dereferences a null kernel for a tensor it has none for,
such as an F32 norm), so overrides would have to restate ggml's kernel table per type, shape and
CPU. Compute needs no change: an extra buffer type's kernels run only on weights stored in a
buffer of that type.

``specdecode env`` prints the choice and why; the "loading ... on llama.cpp" line does too.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

from specdecode.backends.llamacpp_binding import BackendUnavailableError, import_llama_cpp, physical_core_count
from specdecode.backends.llamacpp_decode import TokenBatch
from specdecode.core.device import cpu_flags, cpu_model
from specdecode.core.paths import cache_dir

# The environment variable that forces llama.cpp's extra (repacked) weight buffers on (1) or off (0).
EXTRA_BUFTS_ENV = "SPECDECODE_LLAMACPP_REPACK"
# Test hook: the probe children whose mode (ON, NO_AMX) it names, comma-separated, kill
# themselves with SIGILL before their first pass, as a CPU whose AMX faults does.
PROBE_FAULT_ENV = "SPECDECODE_REPACK_PROBE_FAULT"

ON, NO_AMX, OFF, UNDECIDED = "on", "on without AMX", "off", "not decided yet"
AMX_FLAG = "amx_tile"  # /proc/cpuinfo's flag for AMX's tile registers
AMX_BUFFER = "AMX"  # ggml's name of the AMX buffer type
PROBE_ROWS = (2, 4)  # the passes a probe child runs: the fault came with the first multi-row pass
PROBE_TIMEOUT_S = 600  # loading and repacking a few GB of weights on 2 cores takes well under this
VERDICT_SCHEMA = 1
_PROBE_CHILD = "import sys; from specdecode.backends.llamacpp_repack import probe_child; sys.exit(probe_child(sys.argv[1:]))"
_BUFFER_LINE = re.compile(r"(\S+) model buffer size\s*=")  # llama.cpp's log of each weight buffer


@dataclass(frozen=True, slots=True)
class RepackChoice:
    """How llama.cpp's weights are laid out in this process: ``mode`` is ON (every extra buffer
    type), NO_AMX (all but AMX), OFF (the plain CPU buffer only) or UNDECIDED (no probe has run
    and no model file was given to run one); ``why`` says what decided it."""

    mode: str
    why: str

    @property
    def extra_buffers(self) -> bool:
        """``use_extra_bufts`` for the load."""
        return self.mode in (ON, NO_AMX)

    @property
    def left_out(self) -> tuple[str, ...]:
        """Extra buffer types to drop from ggml's list for the load."""
        return (AMX_BUFFER,) if self.mode == NO_AMX else ()

    def describe(self) -> str:
        return f"repacked weights {self.mode}: {self.why}"


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What one probe child did: ``passed`` its passes, or ``crashed`` (died by a signal), or
    neither (failed with an exit code or timed out); ``buffers``: the weight buffer types its
    load used (empty where llama.cpp's log named none)."""

    passed: bool
    crashed: bool
    detail: str
    buffers: tuple[str, ...] = ()


_verdicts: dict[str, RepackChoice] = {}  # this process's machine verdicts, by verdict digest
_per_model: dict[Path, RepackChoice] = {}  # inconclusive probes: they decide only their file's loads
_list_lock = threading.RLock()  # one edit of ggml's list at a time


def llama_cpp_version() -> str:
    """The installed llama-cpp-python's version (its ggml's speed is part of a timing's identity)."""
    from importlib import metadata

    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return "none"


def use_extra_buffer_types() -> bool:
    """Whether llama.cpp's models load with extra buffers here (the machine's choice, without
    probing: False while it is undecided)."""
    return repack_choice().extra_buffers


def forced_choice() -> RepackChoice | None:
    forced = os.environ.get(EXTRA_BUFTS_ENV)
    if forced not in ("0", "1"):
        return None
    return RepackChoice(ON if forced == "1" else OFF, f"forced by {EXTRA_BUFTS_ENV}={forced}")


def repack_choice(gguf: str | Path | None = None, *, show_progress: bool = False) -> RepackChoice:
    """The layout llama.cpp's weights load with here (see the module docstring for the order of
    the rules). ``gguf``: the file about to be loaded, which a probe runs on where one is needed;
    without it an unprobed AMX machine is UNDECIDED. ``show_progress``: say on stderr that a
    probe runs (it loads the file once more, in a child process)."""
    forced = forced_choice()
    if forced is not None:
        return forced
    if AMX_FLAG not in cpu_flags():
        return RepackChoice(ON, f"this CPU has no AMX (no {AMX_FLAG} among its flags)")
    digest = verdict_digest()
    if digest in _verdicts:
        return _verdicts[digest]
    try:
        names = extra_buffer_names(import_llama_cpp())
    except BackendUnavailableError:
        return RepackChoice(UNDECIDED, "llama-cpp-python is not installed")
    if names is not None and AMX_BUFFER not in names:
        listed = ", ".join(names) or "none"
        return RepackChoice(ON, f"this llama.cpp build has no {AMX_BUFFER} buffer type (its extra buffers: {listed})")
    stored = read_verdict()
    if stored is not None:
        _verdicts[digest] = stored
        return stored
    path = Path(gguf).resolve() if gguf is not None else None
    if path is None or not path.is_file():
        return RepackChoice(UNDECIDED, f"this CPU has AMX and no probe has run yet: the first llama.cpp load probes it ({verdict_path()})")
    if path in _per_model:
        return _per_model[path]
    if show_progress:
        print(f"specdecode: this CPU has AMX; testing it on {path.name} in a child process (once per machine)",
              file=sys.stderr, flush=True)
    choice, conclusive = probe(path, can_leave_out_amx=names is not None)
    if conclusive:
        _verdicts[digest] = choice
        write_verdict(choice, path)
    else:
        _per_model[path] = choice
    return choice


def probe(gguf: Path, can_leave_out_amx: bool = True) -> tuple[RepackChoice, bool]:
    """The choice the probe children make on ``gguf``, and whether it holds for the machine
    (True) or only for this file in this process (False)."""
    full = run_probe(gguf, ON)
    if full.passed:
        if full.buffers and AMX_BUFFER not in full.buffers:
            return RepackChoice(ON, f"{gguf.name} puts no weights in {AMX_BUFFER} buffers: its probe passed without "
                                    "testing AMX, so it decides only this file's loads"), False
        rows = " and ".join(map(str, PROBE_ROWS))
        return RepackChoice(ON, f"AMX probed ok ({rows}-row passes in a child process)"), True
    if not full.crashed:
        return RepackChoice(OFF, f"the AMX probe failed without a fault ({full.detail}); off for {gguf.name} in this run"), False
    if not can_leave_out_amx:
        return RepackChoice(OFF, f"AMX faulted in a probe ({full.detail}) and this llama.cpp offers no list of extra "
                                 "buffers to leave it out of"), True
    bare = run_probe(gguf, NO_AMX, (AMX_BUFFER,))
    if bare.passed:
        return RepackChoice(NO_AMX, f"AMX faulted in a probe ({full.detail}); the repack without it probed ok"), True
    if bare.crashed:
        return RepackChoice(OFF, f"a probe crashed with AMX ({full.detail}) and without it ({bare.detail})"), True
    return RepackChoice(OFF, f"AMX faulted in a probe ({full.detail}); the probe without it failed "
                             f"({bare.detail}); off for {gguf.name} in this run"), False


def run_probe(gguf: Path, mode: str, left_out: Collection[str] = ()) -> ProbeResult:
    """Run ``probe_child`` on ``gguf`` in a fresh interpreter with the extra buffers but
    ``left_out``, and read how it ended."""
    command = [sys.executable, "-c", _PROBE_CHILD, str(gguf), mode, *left_out]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return ProbeResult(False, False, f"no answer within {PROBE_TIMEOUT_S} s")
    if done.returncode < 0:  # killed by a signal: SIGILL where AMX faults
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        return ProbeResult(False, True, name)
    if done.returncode != 0:
        last = next((line for line in reversed(done.stderr.splitlines()) if line.strip()), "no message")
        return ProbeResult(False, False, f"exit {done.returncode}: {last}")
    try:
        buffers = tuple(json.loads(done.stdout.strip().splitlines()[-1])["buffers"])
    except (IndexError, KeyError, TypeError, ValueError):
        buffers = ()
    return ProbeResult(True, False, "passed", buffers)


def probe_child(argv: list[str]) -> int:
    """The probe's child process: ``argv`` is the GGUF path, the mode (ON or NO_AMX, for the
    test hook ``PROBE_FAULT_ENV``) and the extra buffer types to leave out. Loads the file with
    the rest of the extra buffers, runs ``PROBE_ROWS`` passes on the default thread count, and
    prints the weight buffer types the load used as JSON. It uses the binding directly, not
    ``LlamaCppModel``, whose load asks ``repack_choice``."""
    gguf, mode, left_out = argv[0], argv[1], argv[2:]
    llama_cpp = import_llama_cpp()
    log: list[str] = []
    callback = llama_cpp.llama_log_callback(lambda level, text, data: log.append(text.decode(errors="replace") if text else ""))
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP
    params.use_extra_bufts = True
    with extra_buffers_without(llama_cpp, left_out):
        model = llama_cpp.llama_model_load_from_file(os.fsencode(gguf), params)
    if not model:
        print(f"llama.cpp could not load {gguf}", file=sys.stderr)
        return 2
    context_params = llama_cpp.llama_context_default_params()
    context_params.n_ctx = context_params.n_batch = context_params.n_ubatch = max(PROBE_ROWS)
    context_params.n_seq_max = 1
    context_params.n_outputs_max_per_seq = 0  # a logit row for every token: the output layer runs multi-row too
    context_params.n_threads = context_params.n_threads_batch = physical_core_count()
    context = llama_cpp.llama_init_from_model(model, context_params)
    if not context:
        print(f"llama.cpp could not create a context for {gguf}", file=sys.stderr)
        return 2
    if mode in os.environ.get(PROBE_FAULT_ENV, "").split(","):
        os.kill(os.getpid(), signal.SIGILL)
    batch = TokenBatch(llama_cpp, max(PROBE_ROWS))
    for rows in PROBE_ROWS:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(context), True)
        batch.fill(list(range(rows)), list(range(rows)), [0] * rows, [True] * rows)
        code = llama_cpp.llama_decode(context, batch.batch)
        if code != 0:
            print(f"llama_decode failed with code {code} on a {rows}-row pass", file=sys.stderr)
            return 3
    print(json.dumps({"buffers": sorted(set(_BUFFER_LINE.findall("".join(log))))}))
    return 0


# ---------------------------------------------------------------------------- ggml's list


@functools.cache
def _extra_buffer_list(llama_cpp: ModuleType) -> tuple[Any, Any] | None:
    """ggml's null-terminated array of the CPU backend's extra buffer types, as the copy of ggml
    that libllama loads hands it to llama.cpp, with ``ggml_backend_buft_name``; None where the
    binding or the backend does not offer it. (The wheel ships ``libggml-cpu.so`` and
    ``libggml-cpu.so.0`` as two files, so a library is found through libllama's own handle.)"""
    lib = getattr(getattr(llama_cpp, "llama_cpp", None), "_lib", None)
    if lib is None:
        return None
    pointer = ctypes.c_void_p
    try:
        dev_by_type = ctypes.CFUNCTYPE(pointer, ctypes.c_int)(("ggml_backend_dev_by_type", lib))
        backend_reg = ctypes.CFUNCTYPE(pointer, pointer)(("ggml_backend_dev_backend_reg", lib))
        proc_address = ctypes.CFUNCTYPE(pointer, pointer, ctypes.c_char_p)(("ggml_backend_reg_get_proc_address", lib))
        buffer_name = ctypes.CFUNCTYPE(ctypes.c_char_p, pointer)(("ggml_backend_buft_name", lib))
    except AttributeError:
        return None
    device = dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    registry = backend_reg(device) if device else None
    address = proc_address(registry, b"ggml_backend_dev_get_extra_bufts") if registry else None
    if not address:
        return None
    array = ctypes.CFUNCTYPE(ctypes.POINTER(pointer), pointer)(address)(device)
    return (array, buffer_name) if array else None


def extra_buffer_names(llama_cpp: ModuleType) -> list[str] | None:
    """The names of the extra buffer types llama.cpp's next load will try, in order (e.g.
    ``["AMX", "CPU_REPACK"]``); None where the list cannot be read."""
    found = _extra_buffer_list(llama_cpp)
    if found is None:
        return None
    array, buffer_name = found
    with _list_lock:
        return [buffer_name(array[i]).decode() for i in range(_length(array))]


@contextlib.contextmanager
def extra_buffers_without(llama_cpp: ModuleType, names: Collection[str]) -> Iterator[None]:
    """Within the block, llama.cpp's loads see ggml's list of extra buffer types without
    ``names``; the list is whole again after it. Nothing to leave out: no change."""
    if not names:
        yield
        return
    found = _extra_buffer_list(llama_cpp)
    if found is None:
        raise BackendUnavailableError(f"this llama-cpp-python offers no list of extra buffer types to leave {sorted(names)} out of")
    array, buffer_name = found
    with _list_lock:
        whole = [array[i] for i in range(_length(array) + 1)]  # with its null terminator
        kept = [entry for entry in whole[:-1] if buffer_name(entry).decode() not in names]
        for i, entry in enumerate([*kept, None]):
            array[i] = entry
        try:
            yield
        finally:
            for i, entry in enumerate(whole):
                array[i] = entry


def _length(array: Any) -> int:
    count = 0
    while array[count]:
        count += 1
    return count


# ---------------------------------------------------------------------------- stored verdicts


def verdict_key() -> dict[str, Any]:
    """What a probe's verdict depends on: the CPU and the ggml that runs on it."""
    return {"schema": VERDICT_SCHEMA, "cpu": cpu_model(), "flags": sorted(cpu_flags()), "llama_cpp": llama_cpp_version()}


def verdict_digest() -> str:
    return hashlib.sha256(json.dumps(verdict_key(), sort_keys=True).encode()).hexdigest()[:16]


def verdict_path() -> Path:
    """Where this machine's verdict is kept: beside the stored cost tables."""
    return cache_dir() / "costs" / f"repack-{verdict_digest()}.json"


def read_verdict() -> RepackChoice | None:
    """The verdict a probe stored for this machine, or None (none yet, or unreadable)."""
    try:
        stored = json.loads(verdict_path().read_text())
        if stored["key"] == verdict_key() and stored["mode"] in (ON, NO_AMX, OFF):
            return RepackChoice(stored["mode"], f"{stored['why']} (probed {stored['probed']} on {stored['gguf']})")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def write_verdict(choice: RepackChoice, gguf: Path) -> None:
    path = verdict_path()
    record = {"key": verdict_key(), "mode": choice.mode, "why": choice.why, "gguf": gguf.name,
              "probed": datetime.now(UTC).strftime("%Y-%m-%d")}
    with contextlib.suppress(OSError):  # an unwritable cache costs a probe next time, nothing else
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(record, indent=1) + "\n")
        partial.replace(path)


def forget_verdicts() -> None:
    """Drop this process's remembered choices (the stored files stay): for tests."""
    _verdicts.clear()
    _per_model.clear()
