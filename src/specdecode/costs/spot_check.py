"""Whether a stored pass-cost table still describes this machine, and the lines that say why not.

A stored table is a prior, not a verdict (issue 50): one timed while other work loaded the cores
priced a draft pass at 2.70 s where it takes 22.6 ms, every later run decoded plainly because of
it, and a source priced out is never run, so no live timing corrected it. Before a stored table
is trusted, the cost store (``costs/store.py``) checks it two ways:

- for free: its costs must be in order with each other (``out_of_order``): a pass over more rows
  never costs much less than one over fewer, nor much more than their ratio of rows;
- cheaply: this machine's one-row pass, timed now, must not be more than
  ``CONTRADICTION_FACTOR`` faster than the stored one (``contradiction``).

A table that fails either is re-timed as its users need it, and the user reads one line saying so.
"""

from __future__ import annotations

from specdecode.core.timing import NOISE_FLOOR_SECONDS

# How far a stored figure may be from this machine's now before the table is re-timed: wide
# enough that a quiet machine's run-to-run differences (~20%; 51 against 56 ms for the demo
# target's one-row pass) never trip it, narrow enough to catch issue 50's tables (30-120x off).
CONTRADICTION_FACTOR = 2.0
# Repeats of the spot check's one-row pass (after a warm-up): enough for its spread to say
# whether the machine is busy now (core/timing.py), few enough to run at every load.
SPOT_CHECK_REPEATS = 3
# How far out of order two costs may be. A pass over more rows reads the same weights and
# computes more, so it costs at least about as much as one over fewer rows: ggml's kernels change
# at some row counts, but the cheapest such case measured was a 4-row pass at 0.98 of a 2-row one
# (repacked weights, issue 50), so one more than 1.5x cheaper is out of order (this session timed
# the demo draft's 64-row catch-up pass at 1.07 s against 1.80 s for one row, with the target's
# threads and another test run on its 2 cores; 40 ms quiet). And it costs at most about its ratio
# of rows as much: more than twice that is out of order (issue 50's stored table priced a 9-row
# verify at 4.4x an 8-row one).
CHEAPER_SLACK = 1.5
ORDER_SLACK = 2.0


def _conflicts(table: dict[int, float]) -> list[tuple[int, int]]:
    """Every pair (fewer rows, more rows) of ``table`` whose costs are out of order: the pass over
    more rows more than ``CHEAPER_SLACK`` cheaper, or more than ``ORDER_SLACK`` times their ratio
    of rows dearer."""
    rows = sorted(table)
    return [(fewer, more) for i, fewer in enumerate(rows) for more in rows[i + 1:]
            if table[more] < table[fewer] / CHEAPER_SLACK or table[more] > ORDER_SLACK * table[fewer] * more / fewer]


def out_of_order(table: dict[int, float]) -> tuple[int, int] | None:
    """The first pair (fewer rows, more rows) of ``table`` (row count -> seconds) whose costs are
    out of order (``_conflicts``), or None where all are in order."""
    conflicts = _conflicts(table)
    return conflicts[0] if conflicts else None


def outliers(table: dict[int, float]) -> list[int]:
    """The row counts to leave out of ``table`` so that the rest are in order: repeatedly the
    ones in the most conflicting pairs (a shape timed while the machine was busy conflicts with
    most of its neighbours; where two tie, neither can be told right)."""
    kept = dict(table)
    dropped: list[int] = []
    while conflicts := _conflicts(kept):
        counts = {rows: sum(rows in pair for pair in conflicts) for rows in kept}
        most = max(counts.values())
        worst = [rows for rows, count in counts.items() if count == most]
        dropped += worst
        for rows in worst:
            del kept[rows]
    return sorted(dropped)


def contradiction(stored: float, now: float) -> float | None:
    """How many times too high ``stored`` is against ``now``, where it is more than
    ``CONTRADICTION_FACTOR`` too high; None where the stored figure stands.

    Only this direction: load only ever slows a pass, so a ``now`` faster than the stored figure
    proves the stored one too high however busy the machine is, and a table too high is the one
    that turns a source off for good (issue 50). A slower ``now`` is most often a busy machine
    now, even when its repeats agree (a steady load slowed the demo pair's passes 2-3x with
    settled repeats): re-timing the whole table then (37-80 s for the demo pair on 2 cores) would
    price this run by the load and the next quiet run would re-time it back. A difference under
    ``NOISE_FLOOR_SECONDS`` contradicts nothing.
    """
    if stored - now < NOISE_FLOOR_SECONDS or now <= 0.0:
        return None
    factor = stored / now
    return factor if factor > CONTRADICTION_FACTOR else None


def format_seconds(seconds: float) -> str:
    """``seconds`` as a person reads a pass cost: "2.70 s", "22.6 ms", "0.31 ms"."""
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.3g} ms"


def contradicted_note(role: str, factor: float, stored: float, now: float) -> str:
    return (f"stored {role} pass costs were {factor:.0f}x off this machine's now (a {role} pass {format_seconds(stored)} "
            f"stored, {format_seconds(now)} now); re-timed")


def out_of_order_why(fewer: int, more: int, table: dict[int, float]) -> str:
    return f"a {more}-row pass {format_seconds(table[more])} against a {fewer}-row pass {format_seconds(table[fewer])}"


def out_of_order_note(role: str, fewer: int, more: int, table: dict[int, float]) -> str:
    return (f"stored {role} pass costs were out of order ({out_of_order_why(fewer, more, table)}: timed on a busy "
            "machine); re-timed")


def not_stored_note(role: str, rows: list[int], why: str) -> str:
    """The line for fresh timings kept out of the store: ``why`` says what showed the load."""
    shapes = ", ".join(str(r) for r in rows)
    return (f"{role} pass timings over {shapes} rows did not settle ({why}: the machine looks busy); used for this "
            "run but not stored, so the next run times them again")
