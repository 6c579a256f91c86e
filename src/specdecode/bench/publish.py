"""Writing a bench run: ``results.json``, ``report.md``, the plots, and the tables on stdout;
``resummarize`` recomputes a stored run's summary with this version's report code."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import specdecode.bench.output as output
from specdecode.bench.config import BenchConfig
from specdecode.bench.report import summarize
from specdecode.config import SamplingParams
from specdecode.errors import InvalidRequestError

SCHEMA = "specdecode.bench/1"
TABLE_WIDTH = 140


def write_results(results: dict[str, Any], out_dir: Path, plots: bool, console: Any) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "results.json", out_dir / "report.md"]
    output.write_json(results, written[0])
    written[1].write_text(output.markdown_report(results))
    if plots and any(r["repeats"] for r in results["records"]):
        written += output.write_plots(results["summary"], out_dir)
    output.print_tables(results, console)
    return written


def check_optional_dependencies(plots: bool) -> None:
    import importlib.util

    needed = ["rich"] + (["matplotlib"] if plots else [])
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise InvalidRequestError(
            f"specdecode bench needs {' and '.join(missing)}: pip install 'specdecode[bench]'"
            + (" (or pass plots=False to skip matplotlib)" if missing == ["matplotlib"] else "") + "."
        )


def resummarize(path: Path, config: BenchConfig, console: Any = None) -> dict[str, Any]:
    """A stored run's ``results.json`` with its summary recomputed by this version's report code
    (new figures for old runs; no model is loaded, nothing is re-measured), written into
    ``config.out`` like a fresh run."""
    import json

    check_optional_dependencies(config.plots)
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
    if results.get("oracle"):
        from specdecode.bench.oracle_report import rescore

        rescore(results["oracle"], results["records"], results["summary"])
    publish(results, config, console)
    return results


def publish(results: dict[str, Any], config: BenchConfig, console: Any) -> None:
    """Write the results into ``config.out`` and print the tables (to stdout) and the paths."""
    from rich.console import Console

    # Tables go to stdout; when that is a file or pipe, rich would wrap them at 80 columns.
    table_console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else TABLE_WIDTH)
    written = write_results(results, config.out, config.plots, console if config.quiet else table_console)
    console.print("wrote " + ", ".join(str(p) for p in written))
