"""Grammar compiles in a child process, so that a deadline and a memory bound can stop them.

xgrammar compiles in C++ and nothing interrupts it from Python: issue 49 timed the regex
``((a{0,99}){0,99}){0,99}`` compiling for over 180 s in a server thread, which then could not be
stopped (0.4 s here with xgrammar 0.2.9, but nothing bounds a compile's time or memory in
general), and ``root ::= "a" root`` never finished compiling at all. So compiles run in
one child process per vocabulary (``engine/grammar_child.py``, run by path: it imports xgrammar
and nothing of ours), at the lowest CPU priority, one job at a time. The caller waits for its
job up to its deadline, watching the child's resident memory meanwhile; past either bound the
child is killed (the next job starts a new one, about 2 s) and the caller gets an
InvalidRequestError naming the bound. A caller still queued behind another job when its
deadline passes is not waited for either. The compiled grammar comes back serialized
(``CompiledGrammar.serialize_json``) and is rebuilt in the caller's process against its own
tokenizer info.

Why not a thread or a process pool from ``concurrent.futures``: a thread cannot be stopped, and
a pool's worker cannot be killed alone without breaking the pool. Why one child, not several:
each holds its own copy of xgrammar and the tokenizer info (about 300 MB for a 151k vocabulary);
a second would halve the wait behind a slow compile at that cost.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import json
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from specdecode.core.device import resident_bytes
from specdecode.errors import InvalidRequestError

CHILD_SCRIPT = Path(__file__).with_name("grammar_child.py")
# Run the child script by path without putting its folder first on sys.path (this package's
# module names would shadow the standard library's there: engine/trace.py, engine/text.py).
LAUNCH = "import runpy, sys; sys.path.pop(0); runpy.run_path(sys.argv[1], run_name='__main__')"
STARTUP_TIMEOUT_SECONDS = 120.0  # importing xgrammar and reading a 151k vocabulary: ~2 s when idle
POLL_SECONDS = 0.02  # how often a waiting caller checks the child's memory and its deadline
# The child's resident memory past which its compile is stopped: xgrammar and the tokenizer info
# take about 300 MB; the largest compile in the test and benchmark sets adds under 100 MB.
DEFAULT_MEMORY_LIMIT_BYTES = 1536 * 1024 * 1024
COMPILE_THREADS = 2  # xgrammar's threads in the child (at the lowest priority)


class CompileBoundError(InvalidRequestError):
    """A compile stopped by a bound (the deadline, the memory bound, a crash), not refused for its
    content: the same spec may compile on a quieter machine."""


class CompileProcess:
    """One child process compiling for one vocabulary; thread-safe, one job at a time."""

    def __init__(self, tokenizer_info: str, memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES) -> None:
        self.tokenizer_info = tokenizer_info  # xgrammar's TokenizerInfo.serialize_json()
        self.memory_limit_bytes = memory_limit_bytes
        self._lock = threading.Lock()
        self._child: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.starts = 0  # children started (each after the first replaces one killed or dead)

    @property
    def pid(self) -> int | None:
        child = self._child
        return child.pid if child is not None and child.poll() is None else None

    def start(self) -> None:
        """Start the child now (a server calls it at start, so that no request waits for it)."""
        with self._lock:
            self._ensure_started()

    def compile(self, builder: str, args: list[Any], kwargs: dict[str, Any], what: str, timeout: float) -> str:
        """The serialized compiled grammar of ``builder(*args, **kwargs)`` (``grammar_child.BUILDERS``),
        or InvalidRequestError: xgrammar refused it, or some way through it cannot end, or it waited
        ``timeout`` seconds for earlier jobs, or its compile took ``timeout`` seconds, or the child
        grew past the memory bound. ``what`` names the spec."""
        if not self._lock.acquire(timeout=timeout):
            raise _too_slow(what, timeout, queued=True)
        try:
            self._ensure_started()  # a new child's start (~2 s) is not the spec's: its clock starts after
            deadline = time.monotonic() + timeout
            child = self._child
            assert child is not None and child.stdin is not None
            try:
                child.stdin.write(json.dumps({"builder": builder, "args": args, "kwargs": kwargs}) + "\n")
                child.stdin.flush()
            except OSError as err:  # the child died between jobs
                self._kill()
                raise CompileBoundError(f"The {what} could not be compiled: the compiler process failed "
                                          f"({err}); retry the request.") from err
            reply = self._await_reply(child, what, deadline, timeout)
        finally:
            self._lock.release()
        if "error" in reply:
            raise not_compiled(what, reply["error"])
        if "refused" in reply:
            raise refused(what, reply["refused"])
        return str(reply["compiled"])

    def _await_reply(self, child: subprocess.Popen[str], what: str, deadline: float,
                     timeout: float) -> dict[str, Any]:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill()
                raise _too_slow(what, timeout, queued=False)
            try:
                line = self._lines.get(timeout=min(POLL_SECONDS, left))
            except queue.Empty:
                if (resident_bytes(child.pid) or 0) > self.memory_limit_bytes:
                    self._kill()
                    raise CompileBoundError(
                        f"The {what} is too large to compile: its compile took more than "
                        f"{self.memory_limit_bytes // 2**20} MiB and was stopped; send a simpler one.")
                continue
            if line is None:  # the child died mid-job: out of memory in C++ (std::bad_alloc), or killed
                self._kill()
                raise CompileBoundError(f"The {what} could not be compiled: the compiler process failed on it; "
                                          "send a simpler one.")
            return json.loads(line)

    def _ensure_started(self) -> None:
        if self._child is not None and self._child.poll() is None:
            return
        self.starts += 1
        self._lines = queue.Queue()
        child = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, str(CHILD_SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, encoding="utf-8", cwd=tempfile.gettempdir(),
        )
        self._child = child
        lines = self._lines
        threading.Thread(target=_read_lines, args=(child, lines), name="specdecode-grammar-reader", daemon=True).start()
        assert child.stdin is not None
        child.stdin.write(json.dumps({"tokenizer_info": self.tokenizer_info, "threads": COMPILE_THREADS}) + "\n")
        child.stdin.flush()
        try:
            ready = lines.get(timeout=STARTUP_TIMEOUT_SECONDS)
        except queue.Empty:
            ready = None
        if ready is None:
            self._kill()
            raise RuntimeError("The grammar compiler process did not start (is xgrammar importable by "
                               f"{sys.executable}?).")

    def _kill(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        child.kill()
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not refused
            pass
        for stream in (child.stdin, child.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            self._kill()


def _read_lines(child: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
    """The child's answers, a line each, then None at its end (so a waiting caller hears of a death)."""
    assert child.stdout is not None
    try:
        for line in child.stdout:
            lines.put(line)
    except (OSError, ValueError):  # closed under us by _kill
        pass
    lines.put(None)


def not_compiled(what: str, detail: str) -> InvalidRequestError:
    """The error for a spec xgrammar refused: ``detail`` is its message's first line (the rest is a
    C++ trace: ``grammar_child.first_line``), in the compile process or in the caller's thread."""
    return InvalidRequestError(f"The {what} could not be compiled: {detail}")


def refused(what: str, problem: str) -> InvalidRequestError:
    """The error for a grammar in which some way cannot end (``grammar_check.check_grammar``)."""
    return InvalidRequestError(f"The {what} cannot be followed: {problem}. Every way through it must be able to end "
                               "(a required property that contains its own schema, a rule that only refers to itself, "
                               "or a character class that matches nothing cannot).")


def _too_slow(what: str, timeout: float, queued: bool) -> CompileBoundError:
    where = "waiting for other compiles" if queued else "compiling"
    return CompileBoundError(f"The {what} did not compile within the limit of grammar_timeout={timeout:g} seconds "
                               f"(the time ran out {where}); send a simpler one.")


def release_freed_memory() -> None:
    """Hand freed heap memory back to the system (glibc's ``malloc_trim``; a no-op elsewhere).
    Reading a compiled grammar back passes tens of MB of JSON through the heap (64 MB of RSS for
    a 4 MiB grammar of the demo vocabulary); freed, it stayed resident: the server grew by 560 MB
    over eight such compiles. Trimmed after each, it did not grow past the grammars kept."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            _MALLOC_TRIM = ctypes.CDLL(None).malloc_trim
        except (AttributeError, OSError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM: Any = None


_PROCESSES: dict[str, CompileProcess] = {}
_PROCESSES_LOCK = threading.Lock()


def compile_process(tokenizer_info: str) -> CompileProcess:
    """The compile process for a vocabulary, shared by every compiler of that vocabulary in this
    process (tests build many decoders over one tokenizer; a server builds one)."""
    key = hashlib.sha256(tokenizer_info.encode()).hexdigest()
    with _PROCESSES_LOCK:
        process = _PROCESSES.get(key)
        if process is None:
            process = _PROCESSES[key] = CompileProcess(tokenizer_info)
        return process


@atexit.register
def _close_all() -> None:
    for process in list(_PROCESSES.values()):
        process.close()
