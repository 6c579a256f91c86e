"""What a benchmark run leaves behind: terminal tables, results.json, report.md, PNG plots."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdecode.bench.oracle_report import oracle_rows
from specdecode.bench.report import ALL

GIB = 1 << 30
MIB = 1 << 20


def _groups(summary: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """The summary's groups: its categories in run order, then "all"."""
    return list(next(iter(summary.values()), {}))


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def overall_rows(summary: dict[str, dict[str, dict[str, Any]]]) -> tuple[list[list[str]], list[list[str]]]:
    """Two tables over all prompts, one row per method: speed and agreement; cost and limits."""
    speed, cost = [], []
    for method, groups in summary.items():
        e = groups.get(ALL, {})
        split = e.get("time_split") or {}
        eq = e.get("equality") or {}
        speed.append(
            [
                method,
                str(e.get("prompts", 0)) + (f" ({e['failed']} failed)" if e.get("failed") else ""),
                _fmt(e.get("tokens_per_second"), ".2f"),
                _fmt(e.get("speedup_vs_none"), ".2f", "x"),
                _fmt(e.get("decode_speedup_vs_none"), ".2f", "x"),
                _fmt(e.get("speedup_vs_hf"), ".2f", "x"),
                _fmt(e.get("speedup_vs_none_llamacpp"), ".2f", "x"),
                _fmt(e.get("tau"), ".2f"),
                _fmt(e.get("acceptance_rate"), ".0%"),
                (f"{eq['equal_fraction']:.0%} vs {eq['reference']}" if eq.get("equal_fraction") is not None else "-"),
            ]
        )
        cost.append(
            [
                method,
                _fmt(e.get("ceiling_tokens_per_second"), ".1f"),
                _fmt(e.get("fraction_of_ceiling"), ".0%"),
                _fmt(e.get("draft_passes_per_step"), ".2f"),
                " / ".join(f"{split.get(k, 0):.0%}" for k in ("prefill", "draft", "verify", "other")) if split else "-",
                _fmt(e["peak_rss_bytes"] / GIB if e.get("peak_rss_bytes") else None, ".2f"),
                _fmt(e["run_rss_bytes"] / MIB if e.get("run_rss_bytes") is not None else None, ".0f"),
            ]
        )
    return speed, cost


SPEED_HEADER = ["method", "prompts", "tok/s", "vs none", "decode vs none", "vs hf", "vs none@llama.cpp", "tau", "accept", "greedy equal"]
COST_HEADER = ["method", "ceiling tok/s", "of ceiling", "draft passes/step", "prefill / draft / verify / other", "peak RSS GiB", "run +RSS MiB"]
SPEED_TITLE = (
    "All prompts: tokens/s = total new tokens / total seconds; speedups on the same prompts; "
    "decode = the seconds after prefill only"
)
COST_TITLE = "Where the time goes, against the memory-bandwidth ceiling"


def category_rows(
    summary: dict[str, dict[str, dict[str, Any]]], key: str, slower: str = "{}"
) -> tuple[list[str], list[list[str]]]:
    """Methods x categories of one figure (e.g. speedup_vs_none); a speedup below 1 (slower
    than the baseline) is written through the ``slower`` format so that it stands out."""
    categories = _groups(summary)
    rows = []
    for method, groups in summary.items():
        cells = []
        for category in categories:
            value = groups.get(category, {}).get(key)
            if "speedup" in key:
                cell = _fmt(value, ".2f", "x")
                cells.append(slower.format(cell) if value is not None and value < 1.0 else cell)
            else:
                cells.append(_fmt(value, ".2f"))
        rows.append([method] + cells)
    return ["method"] + categories, rows


CATEGORY_TABLES = (
    ("speedup_vs_none", "Speedup over specdecode plain decoding (none) per category"),
    ("decode_speedup_vs_none", "Decode speedup over none per category (the seconds after prefill only)"),
    ("speedup_vs_hf", "Speedup over Hugging Face generate (hf) per category"),
    ("speedup_vs_none_llamacpp", "Speedup over specdecode plain decoding on llama.cpp (none@llama.cpp) per category"),
    ("decode_speedup_vs_none_llamacpp", "Decode speedup over none@llama.cpp per category (the seconds after prefill only)"),
    ("tau", "tau per category (tokens per target pass, bonus token counted)"),
)


def _rich_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> Any:
    from rich.table import Table

    table = Table(title=title)
    for column in header:
        table.add_column(column, justify="left" if column == "method" else "right")
    for row in rows:
        table.add_row(*row)
    return table


def limits_line(results: dict[str, Any]) -> str:
    """The physical limit in one line: bandwidth, bytes per forward pass, plain ceiling."""
    models, bw = results["models"], results["bandwidth"]
    weights = f"target {models['target']['weight_bytes_per_forward'] / 1e9:.2f} GB"
    if models.get("draft"):
        weights += f", draft {models['draft']['weight_bytes_per_forward'] / 1e9:.2f} GB"
    gguf = models.get("llamacpp")
    if gguf:  # the llama.cpp methods read the GGUF files as stored
        weights += f"; on llama.cpp target {gguf['target']['weight_bytes_per_forward'] / 1e9:.2f} GB"
        if gguf.get("draft"):
            weights += f", draft {gguf['draft']['weight_bytes_per_forward'] / 1e9:.2f} GB"
    if not bw.get("copy_bytes_per_second"):
        return f"Weights read per forward pass: {weights}; bandwidth probe skipped, so no ceilings."
    return (
        f"Copy bandwidth {bw['copy_bytes_per_second'] / 1e9:.1f} GB/s (read + written); weights read per forward "
        f"pass: {weights}; plain-decoding ceiling {bw['plain_ceiling_tokens_per_second']:.1f} tokens/s."
    )


def suffix_line(summary: dict[str, dict[str, dict[str, Any]]]) -> str | None:
    """The suffix trees' memory: for each method that keeps earlier responses, its largest cache."""
    parts = [f"{m} {g[ALL]['suffix_cache_tokens']} tokens, {g[ALL]['suffix_cache_bytes_per_token']:.0f} bytes/token"
             for m, g in summary.items() if g.get(ALL, {}).get("suffix_cache_tokens")]
    return "Suffix-tree memory (largest cache of earlier responses): " + "; ".join(parts) + "." if parts else None


def position_rows(summary: dict[str, dict[str, dict[str, Any]]]) -> tuple[list[str], list[list[str]]]:
    """Acceptance per draft position over all prompts, for the methods that report it."""
    per_method = {m: g.get(ALL, {}).get("acceptance_per_position") or [] for m, g in summary.items()}
    depth = max((len(v) for v in per_method.values()), default=0)
    rows = [[m] + [f"{v[i]:.2f}" if i < len(v) else "-" for i in range(depth)] for m, v in per_method.items() if v]
    return ["method"] + [f"pos {i + 1}" for i in range(depth)], rows


POSITION_TITLE = "Acceptance per draft position, all prompts (first i drafts accepted | at least i proposed)"


def print_tables(results: dict[str, Any], console: Any) -> None:
    summary = results["summary"]
    console.print(limits_line(results))
    for title, header, rows in zip((SPEED_TITLE, COST_TITLE), (SPEED_HEADER, COST_HEADER), overall_rows(summary)):
        console.print(_rich_table(title, header, rows))
    for key, title in CATEGORY_TABLES:
        # A method slower than its baseline in a category is what the reader must see.
        header, rows = category_rows(summary, key, slower="[red]{}[/red]")
        if any(cell != "-" for row in rows for cell in row[1:]):
            console.print(_rich_table(title, header, rows))
    header, rows = position_rows(summary)
    if rows:
        console.print(_rich_table(POSITION_TITLE, header, rows))
    if suffix_line(summary):
        console.print(suffix_line(summary))
    for title, header, rows in oracle_rows(results.get("oracle") or {}):
        console.print(_rich_table(title, header, rows))


def markdown_report(results: dict[str, Any]) -> str:
    def md(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
        lines = [f"{title}:", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])

    summary = results["summary"]
    speed, cost = overall_rows(summary)
    parts = [limits_line(results), md(SPEED_TITLE, SPEED_HEADER, speed), md(COST_TITLE, COST_HEADER, cost)]
    for key, title in CATEGORY_TABLES:
        header, rows = category_rows(summary, key, slower="**{}**")
        if not any(cell != "-" for row in rows for cell in row[1:]):
            continue  # e.g. no hf method in the run
        parts.append(md(title + (" (bold: slower than the baseline)" if key.startswith("speedup") else ""), header, rows))
    header, rows = position_rows(summary)
    if rows:
        parts.append(md(POSITION_TITLE, header, rows))
    if suffix_line(summary):
        parts.append(suffix_line(summary))
    for title, header, rows in oracle_rows(results.get("oracle") or {}):
        parts.append(md(title, header, rows))
    return "\n\n".join(parts) + "\n"


def write_plots(summary: dict[str, dict[str, dict[str, Any]]], out_dir: Path) -> list[Path]:
    """speedup.png (per category per method, over none and over hf) and acceptance.png."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    written = []
    methods = list(summary)
    categories = _groups(summary)
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5), sharey=False)
    width = 0.8 / max(1, len(methods))
    for ax, key, title in ((axes[0], "speedup_vs_none", "speedup over none"), (axes[1], "speedup_vs_hf", "speedup over hf")):
        for i, method in enumerate(methods):
            values = [summary[method].get(c, {}).get(key) or 0.0 for c in categories]
            ax.bar([x + i * width for x in range(len(categories))], values, width, label=method)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(categories))], categories, rotation=30, ha="right")
        ax.set_title(title)
        ax.set_ylabel("x (tokens/s ratio, same prompts)")
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    path = out_dir / "speedup.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    plotted = False
    for method in methods:
        for category in categories:
            per_pos = summary[method].get(category, {}).get("acceptance_per_position") or []
            if not per_pos:
                continue
            overall = category == ALL
            ax.plot(
                range(1, len(per_pos) + 1), per_pos, marker="o" if overall else None,
                linewidth=2.2 if overall else 0.9, alpha=1.0 if overall else 0.6,
                label=f"{method} ({category})",
            )
            plotted = True
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(first i drafts accepted | at least i proposed)")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylim(0, 1.02)
    ax.set_title("acceptance per draft position")
    if plotted:
        ax.legend(fontsize="x-small", ncol=2)
    fig.tight_layout()
    path = out_dir / "acceptance.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def write_json(results: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(path)  # a Ctrl-C while writing never leaves half a file
