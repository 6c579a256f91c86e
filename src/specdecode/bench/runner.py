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
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from specdecode.backends.device import dtype_name
from specdecode.bench import output
from specdecode.bench.llamacpp_bin import DEFAULT_BIN_TIMEOUT_SECONDS, LlamaCppBinaryMethod
from specdecode.bench.llamacpp_peers import LlamaCppPyMethod, LlamaCppSide, load_llamacpp_side
from specdecode.bench.methods import (
    DEFAULT_HF_LOOKUP_TOKENS,
    DEFAULT_LLAMACPP_LOOKUP_TOKENS,
    HF_METHODS,
    LLAMACPP_BIN_METHODS,
    LLAMACPP_PY_METHODS,
    BenchMethod,
    HFMethod,
    MethodLabel,
    SpecDecodeMethod,
    available_methods,
    default_methods,
    parse_method,
    uses_draft_model,
)
from specdecode.bench.prompts import BenchPrompt, load_prompts, select_prompts
from specdecode.bench.report import summarize
from specdecode.bench.roofline import DEFAULT_PROBE_BYTES, measure_copy_bandwidth, weight_bytes_per_forward
from specdecode.config import SamplingParams
from specdecode.errors import InvalidRequestError

SCHEMA = "specdecode.bench/1"
WARMUP_PROMPT = "Write a Python function that returns the n-th Fibonacci number."
WARMUP_MAX_NEW_TOKENS = 24
DEFAULT_METHODS = default_methods()  # every specdecode method, then the transformers peers
TABLE_WIDTH = 140


@dataclass(slots=True)
class BenchConfig:
    target: str | None = None
    draft: str | None = None
    methods: tuple[str, ...] = DEFAULT_METHODS
    prompts: tuple[str, ...] = ("default",)
    categories: tuple[str, ...] = ("all",)
    max_prompts_per_category: int | None = 3
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = 0
    k: int | None = None
    draft_confidence: float | None = None
    ngram_max: int | None = None
    ngram_min: int | None = None
    skip_layers: tuple[int, ...] | None = None  # layerskip (default: the demo target's tuned choice)
    layerskip_config: str | None = None
    # Trained heads (``specdecode train``) for the medusa and eagle methods, and their tree size.
    medusa_heads: str | None = None
    eagle_heads: str | None = None
    tree_size: int | None = None
    hf_lookup_tokens: int = DEFAULT_HF_LOOKUP_TOKENS
    llamacpp_lookup_tokens: int = DEFAULT_LLAMACPP_LOOKUP_TOKENS  # num_pred_tokens of llamacpp-lookup
    llamacpp_bin: str | None = None  # folder of llama.cpp's binaries, for llamacpp-bin-*
    llamacpp_bin_timeout: float = DEFAULT_BIN_TIMEOUT_SECONDS  # per turn
    repeats: int = 1
    warmup: bool = True
    chat: bool | None = None  # None: use the chat template when the tokenizer has one
    dtype: str = "auto"
    device: str = "auto"
    kv_dtype: str = "auto"  # KV-cache storage of specdecode's methods: auto or int8
    bandwidth_probe_bytes: int = DEFAULT_PROBE_BYTES  # 0 skips the probe (and the ceilings)
    out: Path = Path("results")
    plots: bool = True
    quiet: bool = False

    def __post_init__(self) -> None:
        if not self.methods:
            raise InvalidRequestError(f"No methods given; choose from: {', '.join(available_methods())}.")
        for method in self.methods:
            parse_method(method)  # raises a clear error for unknown methods or quantizations
        from specdecode.kv.static import check_kv_dtype

        check_kv_dtype(self.kv_dtype)
        if len(set(self.methods)) != len(self.methods):
            raise InvalidRequestError("Each method may be listed once.")
        if self.repeats < 1:
            raise InvalidRequestError(f"--repeats must be >= 1, got {self.repeats}.")
        if self.max_prompts_per_category is not None and self.max_prompts_per_category < 1:
            raise InvalidRequestError("--max-prompts-per-category must be >= 1.")
        if self.hf_lookup_tokens < 1:
            raise InvalidRequestError("--hf-lookup-tokens must be >= 1.")
        if self.llamacpp_lookup_tokens < 1:
            raise InvalidRequestError("--llamacpp-lookup-tokens must be >= 1.")
        if self.llamacpp_bin_timeout <= 0:
            raise InvalidRequestError("--llamacpp-bin-timeout must be > 0 seconds.")
        binaries = [m for m in self.methods if m in LLAMACPP_BIN_METHODS]
        if binaries and self.llamacpp_bin is None:
            raise InvalidRequestError(
                f"Methods {', '.join(binaries)} run llama.cpp's own binaries: pass --llamacpp-bin DIR, the folder "
                "`bash /work/shared/tools/build-llamacpp-tools.sh` prints (it builds them in about 10 minutes)."
            )
        self.sampling()  # validates temperature, top-k, top-p, max_new_tokens

    def sampling(self, max_new_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            max_new_tokens=max_new_tokens or self.max_new_tokens, seed=self.seed,
        )


def environment(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    import transformers

    from specdecode import __version__

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
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


def _layerskip_configured(config: BenchConfig) -> bool:
    from specdecode.models import demo
    from specdecode.training.layer_search import builtin_choice

    return bool(config.skip_layers or config.layerskip_config or builtin_choice(config.target or demo.DEFAULT_TARGET))


class Bench:
    """Loaded models and methods; ``run`` measures the prompts and returns the results dict."""

    def __init__(self, config: BenchConfig) -> None:
        from specdecode.api import SpecDecoder
        from specdecode.drafters.layer_skip import resolve_skip_layers

        if config.methods == DEFAULT_METHODS and not _layerskip_configured(config):
            # The default "every method" cannot include layer skip for a target nobody tuned it for.
            config = replace(config, methods=tuple(m for m in config.methods if m != "layerskip"))
            if not config.quiet:
                print("bench: layerskip left out (no --skip-layers or --layerskip-config for this target)", file=sys.stderr)
        heads_given = {"medusa": config.medusa_heads, "eagle": config.eagle_heads}
        if config.methods == DEFAULT_METHODS:
            untrained = [m for m, folder in heads_given.items() if folder is None]
            config = replace(config, methods=tuple(m for m in config.methods if m not in untrained))
            if untrained and not config.quiet:
                print(f"bench: {', '.join(untrained)} left out (no --{untrained[0]}-heads given)", file=sys.stderr)
        for name in config.methods:
            base = parse_method(name).base
            if base in heads_given and heads_given[base] is None:
                raise InvalidRequestError(
                    f"Method {name} needs trained heads: pass --{base}-heads FOLDER (from `specdecode train {base}`)."
                )
        self.config = config
        labels = {name: parse_method(name) for name in config.methods}
        # The torch decoder loads a draft model only for torch methods; llama.cpp's side has its own.
        needs_draft = any(uses_draft_model(m) for m in config.methods if not labels[m].on_llamacpp)
        self.decoder = SpecDecoder.from_pretrained(
            config.target, config.draft, method="draft" if needs_draft else "none",
            k=config.k, draft_confidence=config.draft_confidence,
            ngram_max=config.ngram_max, ngram_min=config.ngram_min,
            skip_layers=config.skip_layers, layerskip_config=config.layerskip_config,
            dtype=config.dtype, device=config.device, kv_dtype=config.kv_dtype, backend="torch",
            show_progress=not config.quiet,
        )
        if any(label.base == "layerskip" for label in labels.values()) and not self.decoder.spec.skip_layers:
            # No layers given: the target's built-in tuned choice (the demo target has one).
            target = self.decoder.target
            skip = resolve_skip_layers(target.name, target.config.num_layers, None, None)
            self.decoder = SpecDecoder(target, self.decoder.draft, replace(self.decoder.spec, skip_layers=skip), kv_dtype=config.kv_dtype)
        from specdecode.models.heads import load_heads

        self.heads = {
            kind: load_heads(folder, self.decoder.target.model.dtype, self.decoder.target.model.device)
            for kind, folder in heads_given.items()
            if folder is not None and any(parse_method(m).base == kind for m in config.methods)
        }
        for heads in self.heads.values():
            self.decoder.attach_heads(heads, config.tree_size)
        # Quantized variants share one loaded model per (role, quantization) and get a decoder
        # per (target quant, draft quant) pair.
        loaded = {("target", "none"): self.decoder.target, ("draft", "none"): self.decoder.draft}
        decoders = {("none", "none", self.decoder.draft is not None): self.decoder}

        def model(role: str, quant: str) -> Any:
            if (role, quant) not in loaded:
                from specdecode.models.loader import load_model

                source = self.decoder.target if role == "target" else self.decoder.draft
                loaded[role, quant] = load_model(source.name, source.model.dtype, source.model.device, not config.quiet, quant)
            return loaded[role, quant]

        def decoder_for(target_quant: str, draft_quant: str, with_draft: bool) -> Any:
            key = (target_quant, draft_quant if with_draft else "none", with_draft)
            if key not in decoders:
                draft = model("draft", key[1]) if with_draft else None
                spec = self.decoder.spec if with_draft else replace(self.decoder.spec, method="none")
                decoders[key] = SpecDecoder(model("target", key[0]), draft, spec, kv_dtype=config.kv_dtype)
                for heads in self.heads.values():  # trained on the unquantized target's features
                    decoders[key].attach_heads(heads, config.tree_size)
            return decoders[key]

        self.device = self.decoder.target.model.device
        self.dtype = self.decoder.target.model.dtype
        self.tokenizer = self.decoder.tokenizer
        self.chat = bool(getattr(self.tokenizer, "chat_template", None)) if config.chat is None else config.chat
        self.methods: dict[str, BenchMethod] = {}
        hf_target = hf_draft = None
        if any(m in HF_METHODS for m in config.methods):
            hf_target = self._load_hf(self.decoder.target.folder)
            if "hf-assisted" in config.methods:
                hf_draft = self._load_hf(self.decoder.draft.folder)
        self.llamacpp = self._load_llamacpp_side({n: label for n, label in labels.items() if label.on_llamacpp})
        for name in config.methods:
            if name in HF_METHODS:
                self.methods[name] = HFMethod(name, hf_target, self.tokenizer, list(self.decoder.eos_token_ids), hf_draft, config.hf_lookup_tokens)
            elif labels[name].on_llamacpp:
                self.methods[name] = self._llamacpp_method(name)
            else:
                label = labels[name]
                decoder = decoder_for(label.target_quant, label.draft_quant, uses_draft_model(label.base) and self.decoder.draft is not None)
                self.methods[name] = SpecDecodeMethod(name, decoder, config.k)
        draft = self.decoder.draft
        self.target_bytes = weight_bytes_per_forward(self.decoder.target.config, self.dtype)
        self.draft_bytes = weight_bytes_per_forward(draft.config, self.dtype) if draft is not None else 0
        # (target, draft) bytes per forward pass of each method, as its weights are stored.
        self.weight_bytes = {
            name: (
                weight_bytes_per_forward(self.decoder.target.config, self.dtype, labels[name].target_quant),
                self._draft_bytes(labels[name], draft),
            )
            for name in config.methods
            if not labels[name].on_llamacpp
        }
        if self.llamacpp is not None:  # llama.cpp reads the GGUF files' own (quantized) bytes
            side = self.llamacpp
            for name, label in labels.items():
                if label.on_llamacpp:
                    self.weight_bytes[name] = (side.target_bytes, side.draft_bytes if uses_draft_model(label.base) else 0)
        self.weight_bytes = {name: self.weight_bytes[name] for name in config.methods}  # run order

    def _load_llamacpp_side(self, labels: dict[str, MethodLabel]) -> LlamaCppSide | None:
        """The llama.cpp side (GGUF files, our decoder there) when any label asks for it."""
        if not labels:
            return None
        from specdecode.backends.llamacpp_sequence import DEFAULT_CONTEXT
        from specdecode.models import demo

        config = self.config
        target = config.target or demo.DEFAULT_TARGET
        draft = config.draft or (demo.DEFAULT_DRAFT if demo.is_demo_model_name(target) else None)
        return load_llamacpp_side(
            target, draft, labels, dtype=config.dtype, show_progress=not config.quiet,
            # Our backend's context, capped at what the model was trained for.
            context=min(DEFAULT_CONTEXT, self.decoder.target.config.max_position_embeddings),
            k=config.k, draft_confidence=config.draft_confidence, ngram_max=config.ngram_max, ngram_min=config.ngram_min,
        )

    def _llamacpp_method(self, name: str) -> BenchMethod:
        side, config = self.llamacpp, self.config
        assert side is not None
        eos = list(self.decoder.eos_token_ids)
        if name in LLAMACPP_PY_METHODS:
            return LlamaCppPyMethod(name, side.files.target, self.tokenizer, eos, exact=side.exact, context=side.context,
                                    lookup_tokens=config.llamacpp_lookup_tokens)
        if name in LLAMACPP_BIN_METHODS:
            assert config.llamacpp_bin is not None  # BenchConfig checked it
            return LlamaCppBinaryMethod(name, Path(config.llamacpp_bin), side.files.target, side.files.draft, self.tokenizer, eos,
                                        threads=side.threads, context=side.context, exact=side.exact, k=config.k,
                                        timeout=config.llamacpp_bin_timeout)
        return SpecDecodeMethod(name, side.decoder, config.k)

    def _draft_bytes(self, label: MethodLabel, draft: Any) -> int:
        """Weight bytes one draft pass of the method reads, as stored."""
        if label.base == "layerskip":  # the target's own weights, minus the skipped layers
            target = self.decoder.target.config
            kept = replace(target, num_layers=target.num_layers - len(self.decoder.spec.skip_layers))
            return weight_bytes_per_forward(kept, self.dtype, label.target_quant)
        if label.base in self.heads:  # every head weight (the reduced LM head included)
            return sum(p.numel() * p.element_size() for p in self.heads[label.base].parameters())
        if draft is None or not uses_draft_model(label.base):
            return 0
        return weight_bytes_per_forward(draft.config, self.dtype, label.draft_quant)

    def _load_hf(self, folder: Path) -> Any:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(folder, dtype=self.dtype).to(self.device).eval()

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        if self.chat:
            return self.decoder.encode(messages, chat=True)
        # Without a chat template a conversation is its messages joined by blank lines.
        return self.decoder.encode("\n\n".join(m["content"] for m in messages))

    def run_conversation(self, method: BenchMethod, turns: tuple[str, ...], params: SamplingParams) -> list[dict[str, Any]]:
        """All turns of one prompt, each answer going into the next turn's history."""
        messages: list[dict[str, str]] = []
        results = []
        if hasattr(method, "start_conversation"):
            method.start_conversation()
        for turn in turns:
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
                    for _ in range(config.repeats):
                        for name, method in self.methods.items():
                            progress.update(task, description=f"[{index + 1}/{len(prompts)}] {prompt.prompt_id} {name}")
                            record = row[name]
                            if record["error"] is None:
                                try:
                                    turns = self.run_conversation(method, prompt.turns, params)
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
        return {
            "schema": SCHEMA,
            "complete": not interrupted,
            "env": env,
            "config": {key: (str(v) if isinstance(v, Path) else v) for key, v in asdict(config).items()},
            "chat_template": self.chat,
            "num_speculative_tokens": self.decoder.spec.k,
            "draft_confidence": self.decoder.spec.draft_confidence,
            "models": {
                "target": {"name": self.decoder.target.name, "weight_bytes_per_forward": self.target_bytes},
                "draft": {"name": self.decoder.draft.name, "weight_bytes_per_forward": self.draft_bytes} if self.decoder.draft else None,
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
            "warmup_errors": warmup_errors,
            "prompts": [asdict(p) for p in prompts],
            "summary": summary,
            "failures": [{"prompt_id": r["prompt_id"], "method": r["method"], "error": r["error"]} for r in records if r["error"]],
            "records": records,
        }


def write_results(results: dict[str, Any], out_dir: Path, plots: bool, console: Any) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "results.json", out_dir / "report.md"]
    output.write_json(results, written[0])
    written[1].write_text(output.markdown_report(results))
    if plots and any(r["repeats"] for r in results["records"]):
        written += output.write_plots(results["summary"], out_dir)
    output.print_tables(results, console)
    return written


def _check_optional_dependencies(plots: bool) -> None:
    import importlib.util

    needed = ["rich"] + (["matplotlib"] if plots else [])
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise InvalidRequestError(
            f"specdecode bench needs {' and '.join(missing)}: pip install 'specdecode[bench]'"
            + (" (or pass --no-plots to skip matplotlib)" if missing == ["matplotlib"] else "") + "."
        )


def resummarize(path: Path, config: BenchConfig, console: Any = None) -> dict[str, Any]:
    """A stored run's ``results.json`` with its summary recomputed by this version's report code
    (new figures for old runs; no model is loaded, nothing is re-measured), written into
    ``config.out`` like a fresh run."""
    import json

    _check_optional_dependencies(config.plots)
    from rich.console import Console

    console = console or Console(stderr=True, quiet=config.quiet)
    try:
        results = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise InvalidRequestError(f"Cannot read bench results {path}: {err}") from err
    if not isinstance(results, dict) or results.get("schema") != SCHEMA:
        raise InvalidRequestError(f"{path} is not a specdecode bench results.json (schema {SCHEMA}).")
    stored, models = results["config"], results["models"]
    if "weight_bytes_by_method" in models:
        weight_bytes = {name: tuple(pair) for name, pair in models["weight_bytes_by_method"].items()}
    else:  # runs from before quantized variants: every method read the same two models
        pair = tuple((models[role] or {}).get("weight_bytes_per_forward", 0) for role in ("target", "draft"))
        weight_bytes = {name: pair for name in stored["methods"]}
    results["summary"] = summarize(
        results["records"], list(stored["methods"]), SamplingParams(temperature=stored["temperature"]).greedy, weight_bytes,
        results["bandwidth"]["copy_bytes_per_second"],
    )
    _publish(results, config, console)
    return results


def _publish(results: dict[str, Any], config: BenchConfig, console: Any) -> None:
    """Write the results into ``config.out`` and print the tables (to stdout) and the paths."""
    from rich.console import Console

    # Tables go to stdout; when that is a file or pipe, rich would wrap them at 80 columns.
    table_console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else TABLE_WIDTH)
    written = write_results(results, config.out, config.plots, console if config.quiet else table_console)
    console.print("wrote " + ", ".join(str(p) for p in written))


def run_bench(config: BenchConfig, console: Any = None) -> dict[str, Any]:
    """Load, measure, write ``results.json``, ``report.md`` and the plots into ``config.out``."""
    _check_optional_dependencies(config.plots)
    from rich.console import Console

    console = console or Console(stderr=True, quiet=config.quiet)
    prompts = select_prompts(load_prompts(config.prompts), config.categories, config.max_prompts_per_category)
    if not prompts:
        raise InvalidRequestError("No prompts selected.")
    bench = Bench(config)
    results = bench.run(prompts, console)
    _publish(results, config, console)
    return results
