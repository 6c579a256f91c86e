"""``specdecode bench``: every method on the same prompts, interleaved, in one process.

For each prompt, for each repeat, every method runs in turn (A B C A B C ...) so that drift
(thermal state, other load) hits all methods alike. A warm-up prompt runs first for every
method (first-shape kernels, page-ins). A method that raises on a prompt is recorded as
failed with its error and the run goes on; Ctrl-C stops the run and what was measured so far
is still summarised and written.
"""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specdecode.bench.config import DEFAULT_METHODS, BenchConfig
from specdecode.bench.lineup import BenchLineup
from specdecode.bench.methods import PLAIN_LLAMACPP_METHOD, PLAIN_METHOD, BenchMethod, SpecDecodeMethod, parse_method
from specdecode.bench.publish import SCHEMA, check_optional_dependencies, publish, resummarize, write_results
from specdecode.bench.report import summarize
from specdecode.bench.roofline import measure_copy_bandwidth
from specdecode.config import SamplingParams
from specdecode.core.device import cpu_model, dtype_name
from specdecode.engine.trace import PassTrace, save_traces
from specdecode.errors import InvalidRequestError
from specdecode.prompt_sets import BenchPrompt, load_prompts, select_prompts

if TYPE_CHECKING:
    from specdecode.bench.oracle_report import OracleGroup

# Re-exported: the bench's entry points have long been importable from here.
__all__ = ["DEFAULT_METHODS", "Bench", "BenchConfig", "resummarize", "run_bench", "write_results"]

WARMUP_PROMPT = "Write a Python function that returns the n-th Fibonacci number."
WARMUP_MAX_NEW_TOKENS = 24


def environment(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    import transformers

    from specdecode import __version__

    cpu = cpu_model()
    try:
        here = Path(__file__).parent
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5, cwd=here).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=5, cwd=here).stdout.strip()) if commit else None
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "specdecode": __version__,
        "git_commit": commit,
        "git_dirty": dirty,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "dtype": dtype_name(dtype),
    }


def _reset_peak_rss() -> None:
    """Linux resets VmHWM (the peak resident set) on writing 5 to clear_refs."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _status_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _peak_rss_bytes() -> int:
    peak = _status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Bench(BenchLineup):
    """A loaded lineup; ``run`` measures the prompts and returns the results dict."""

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        if self.chat:
            return self.decoder.encode(messages, chat=True)
        # Without a chat template a conversation is its messages joined by blank lines.
        return self.decoder.encode("\n\n".join(m["content"] for m in messages))

    def run_conversation(self, method: BenchMethod, turns: tuple[str, ...], params: SamplingParams,
                         trace_key: tuple[str, str, int] | None = None) -> list[dict[str, Any]]:
        """All turns of one prompt, each answer going into the next turn's history; a traced
        method's passes (``--oracle``) kept under ``trace_key`` (method, prompt id, repeat)."""
        messages: list[dict[str, str]] = []
        results = []
        if hasattr(method, "start_conversation"):
            method.start_conversation()
        turn_traces: list[PassTrace] = []
        for index, turn in enumerate(turns):
            messages.append({"role": "user", "content": turn})
            prompt_ids = self.encode(messages)
            _reset_peak_rss()
            rss_before = _status_bytes("VmRSS")
            result = method.run_turn(prompt_ids, params)
            result.peak_rss_bytes = _peak_rss_bytes()
            if rss_before is not None:
                result.run_rss_bytes = max(0, result.peak_rss_bytes - rss_before)
            messages.append({"role": "assistant", "content": result.text})
            results.append(result.to_dict())
            trace = getattr(method, "last_trace", None)
            if trace_key is not None and trace is not None:
                trace.meta.update(method=trace_key[0], prompt_id=trace_key[1], repeat=trace_key[2], turn=index,
                                  prompt_tokens=len(prompt_ids), tokens=len(result.tokens))
                turn_traces.append(trace)
        if trace_key is not None and turn_traces:
            self.traces[trace_key] = turn_traces
        return results

    def run(self, prompts: list[BenchPrompt], console: Any = None) -> dict[str, Any]:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        config = self.config
        console = console or Console(stderr=True, quiet=config.quiet)
        params = config.sampling()
        self.traces: dict[tuple[str, str, int], list[PassTrace]] = {}
        oracle_groups = self._oracle_groups() if config.oracle else []
        for group in oracle_groups:
            for name in group.methods:
                self.methods[name].trace = True  # type: ignore[attr-defined]  # a SpecDecodeMethod
        load_peak_rss = _peak_rss_bytes()  # every model loaded, before the turns reset the peak
        env = environment(self.device, self.dtype)
        probes: list[float] = []  # before and after the run: drift shows as a difference
        if config.bandwidth_probe_bytes > 0:
            console.print("measuring copy bandwidth ...")
            probes.append(measure_copy_bandwidth(self.device, config.bandwidth_probe_bytes))
        records: list[dict[str, Any]] = []
        interrupted = False
        started = time.perf_counter()
        warmup_errors: dict[str, str] = {}
        total = sum(len(p.turns) for p in prompts) * len(self.methods) * config.repeats
        progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("left"), TimeRemainingColumn(), console=console, disable=config.quiet,
        )
        try:
            with progress:
                if config.warmup:
                    warm = progress.add_task("warm-up", total=len(self.methods))
                    for name, method in self.methods.items():
                        try:
                            self.run_conversation(method, (WARMUP_PROMPT,), config.sampling(min(WARMUP_MAX_NEW_TOKENS, config.max_new_tokens)))
                        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                            warmup_errors[name] = f"{type(exc).__name__}: {exc}"
                        progress.advance(warm)
                task = progress.add_task("bench", total=total)
                for index, prompt in enumerate(prompts):
                    row = {name: {"prompt_id": prompt.prompt_id, "category": prompt.category, "subcategory": prompt.subcategory,
                                  "method": name, "turns": len(prompt.turns), "repeats": [], "error": None} for name in self.methods}
                    for repeat in range(config.repeats):
                        for name, method in self.methods.items():
                            progress.update(task, description=f"[{index + 1}/{len(prompts)}] {prompt.prompt_id} {name}")
                            record = row[name]
                            if record["error"] is None:
                                try:
                                    turns = self.run_conversation(method, prompt.turns, params,
                                                                  (name, prompt.prompt_id, repeat))
                                    record["repeats"].append(turns)
                                    tokens = sum(len(t["tokens"]) for t in turns)
                                    seconds = sum(t["seconds"] for t in turns)
                                    console.print(f"{prompt.prompt_id:24s} {name:12s} {tokens:5d} tokens {tokens / seconds:8.2f} tok/s")
                                except (KeyboardInterrupt, MemoryError):
                                    raise
                                except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                                    record["error"] = f"{type(exc).__name__}: {exc}"
                                    record["traceback"] = traceback.format_exc(limit=4)
                                    console.print(f"[red]{name} failed on {prompt.prompt_id}: {record['error']}[/red]")
                            progress.advance(task, len(prompt.turns))
                    records.extend(row.values())
        except KeyboardInterrupt:
            interrupted = True  # the prompt in flight is dropped; everything before it is kept
            console.print("[yellow]interrupted: writing what was measured so far[/yellow]")
        if probes and not interrupted:
            probes.append(measure_copy_bandwidth(self.device, config.bandwidth_probe_bytes))
        bandwidth = max(probes) if probes else None
        summary = summarize(records, list(self.methods), params.greedy, self.weight_bytes, bandwidth)
        oracle = None
        if oracle_groups and records:
            from specdecode.bench.oracle_report import oracle_results

            console.print("oracle: scoring the drafters at every position of the plain outputs ...")
            with progress:
                task = progress.add_task("oracle", total=len(prompts) * len(oracle_groups))
                oracle = oracle_results(oracle_groups, prompts, records, self.traces, self.encode, summary,
                                        lambda: progress.advance(task))
        return {
            "schema": SCHEMA,
            "complete": not interrupted,
            "env": env,
            "config": {key: (str(v) if isinstance(v, Path) else v) for key, v in asdict(config).items()},
            "chat_template": self.chat,
            "num_speculative_tokens": self.decoder.config.draft_k,
            "draft_confidence": self.decoder.config.draft_confidence,
            "models": {
                "target": {"name": _model_name(self.decoder.target.name), "weight_bytes_per_forward": self.target_bytes},
                "draft": {"name": _model_name(self.decoder.draft.name), "weight_bytes_per_forward": self.draft_bytes}
                if self.decoder.draft else None,
                "weight_bytes_by_method": {name: list(pair) for name, pair in self.weight_bytes.items()},
                "llamacpp": self.llamacpp.describe() if self.llamacpp is not None else None,
            },
            "bandwidth": {
                "copy_bytes_per_second": bandwidth,
                "probes_bytes_per_second": probes,
                "probe_bytes": config.bandwidth_probe_bytes,
                "plain_ceiling_tokens_per_second": bandwidth / self.target_bytes if bandwidth else None,
            },
            "wall_seconds": time.perf_counter() - started,
            "load_peak_rss_bytes": load_peak_rss,
            "compile": [asdict(log) for log in self.compile_logs],
            "warmup_errors": warmup_errors,
            "prompts": [asdict(p) for p in prompts],
            "summary": summary,
            "oracle": oracle,
            "failures": [{"prompt_id": r["prompt_id"], "method": r["method"], "error": r["error"]} for r in records if r["error"]],
            "records": records,
        }


    def _oracle_groups(self) -> list[OracleGroup]:
        """The oracle's groups (``--oracle``): one per plain decoding in the run (torch, llama.cpp),
        with the traced methods its cost table prices and the decoder holding their drafters."""
        from specdecode.bench.oracle_report import ORACLE_BASES, OracleGroup

        groups = []
        for plain, decoder in ((PLAIN_METHOD, self.decoder),
                               (PLAIN_LLAMACPP_METHOD, self.llamacpp.decoder if self.llamacpp else None)):
            if plain not in self.methods or decoder is None:
                continue
            labels = {n: parse_method(n) for n, m in self.methods.items() if isinstance(m, SpecDecodeMethod)}
            names = [n for n, label in labels.items() if label.plain == plain and label.base in ORACLE_BASES]
            groups.append(OracleGroup(plain, decoder, names))
        return groups

    def trace_header(self) -> dict[str, Any]:
        """What a replay of this run's traces needs (bench/replay.py): the models' shapes."""
        from specdecode.bench.replay import full_model_config, model_config_dict

        draft = self.decoder.draft or (self.llamacpp.decoder.draft if self.llamacpp else None)
        return {"target": model_config_dict(full_model_config(self.decoder.target)),
                "draft": model_config_dict(full_model_config(draft)) if draft is not None else None,
                "dtype": dtype_name(self.dtype), "cpu": cpu_model()}


def run_bench(config: BenchConfig, console: Any = None) -> dict[str, Any]:
    """Load, measure, write ``results.json``, ``report.md`` and the plots into ``config.out``."""
    check_optional_dependencies(config.plots)
    from rich.console import Console

    console = console or Console(stderr=True, quiet=config.quiet)
    prompts = select_prompts(load_prompts(config.prompts), config.categories, config.max_prompts_per_category)
    if not prompts:
        raise InvalidRequestError("No prompts selected.")
    bench = Bench(config)
    results = bench.run(prompts, console)
    publish(results, config, console)
    if bench.traces:  # --oracle: every traced turn, to price again or replay on another device
        path = config.out / "traces.json"
        traces = [t for turns in bench.traces.values() for t in turns]
        save_traces(traces, path, bench.trace_header())
        console.print(f"wrote {path} ({len(traces)} traced turns)")
    return results


def _model_name(name: str) -> str:
    """A model as results record it: a local file's or folder's name, not its path (results are
    shared between machines), or the hub id or demo name as given."""
    path = Path(name).expanduser()
    return path.resolve().name if path.exists() else name
