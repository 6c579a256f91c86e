"""One method registry (issue 45 item 2): a method is one entry in ``core/registry.py`` plus
its drafter, and nothing else in src/specdecode names it. These tests prove it by reading the
source: every string constant that equals a method's name (docstrings aside) must sit in a place
listed below, each with the reason it may. A new ``("none", "ngram", ...)`` tuple, a dict keyed
by method names or an ``if method == "medusa"`` outside those places fails here.

Three names are also ordinary words. ``auto`` (a device, a dtype, a tool choice) counts only
where it stands for a method: compared with, passed as, defaulted to or collected under a name
that says ``method``. ``none`` is plain decoding, the k = 0 case that every path knows, and
``draft`` is also the draft model's role (its KV blocks, its passes): those two count only in a
list of methods (a tuple, list, set or dict under a name that says ``method`` or ``planner``),
not where code compares a request's method with plain decoding. The other names count wherever
they appear.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from specdecode.backends.select import LLAMACPP, TORCH, TORCH_ONLY_METHODS
from specdecode.config import DRAFT_MODEL_METHODS, METHODS, TREE_METHODS
from specdecode.core import registry
from specdecode.drafters.planner import PLANNERS
from specdecode.engine.batch_rows import BATCH_METHODS

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "specdecode"
NAMES = frozenset(registry.METHODS)
ORDINARY_WORDS = frozenset({"none", "auto", "draft"})
LISTS_ONLY = frozenset({"none", "draft"})  # counted only in a list of methods

# Where a method's name may appear: the registry, and each method's own drafter module.
OWN_MODULES = {
    "core/registry.py": "the registry itself",
    "drafters/auto.py": "auto's drafter: its sources are named after the methods they stand in for",
    "drafters/auto_row.py": "auto's batch row: the same source labels",
}
# (module, name): why the name appears there. Keep this short; each entry is a debt or a
# different meaning of the same word.
ALLOWED = {
    ("backends/select.py", "layerskip"): "TORCH_ONLY_METHODS, a copy checked equal to the registry's below",
    ("backends/select.py", "medusa"): "the same copy",
    ("backends/select.py", "eagle"): "the same copy",
    ("backends/compiled.py", "auto"): "which verify shapes to warm up: auto's adaptive k (to read the registry)",
    ("engine/batch_rows.py", "ngram"): "row_drafters builds each batch row's host drafter by method (issue 45 item 1)",
    ("engine/batch_rows.py", "suffix"): "the same dispatch",
    ("engine/batch_rows.py", "auto"): "the same dispatch",
    ("models/heads.py", "medusa"): "a heads file's kind, which the method of the same name loads",
    ("models/heads.py", "eagle"): "the same kinds",
    ("training/heads.py", "medusa"): "the kinds of heads `specdecode train` trains",
    ("training/heads.py", "eagle"): "the same kinds",
    ("cli/train.py", "medusa"): "the `train` command's kind argument",
    ("cli/train.py", "eagle"): "the same kinds",
    ("bench/oracle.py", "ngram"): "the oracle's sources, auto's source labels",
    ("bench/oracle.py", "suffix"): "the same sources",
    ("bench/oracle_report.py", "ngram"): "the oracle's columns: plain, each source, auto",
    ("bench/oracle_report.py", "suffix"): "the same columns",
    ("bench/lineup.py", "layerskip"): "the bench's lineup drops layerskip without a tuned file (to read the registry)",
    ("bench/lineup.py", "medusa"): "the bench's heads per method (to read the registry)",
    ("bench/lineup.py", "eagle"): "the same",
    ("serving/protocol.py", "suffix"): "the request's suffix_group field defaults (to read the registry)",
}


def _named_method(node: ast.AST) -> bool:
    """Whether ``node`` is a name, attribute, subscript or call whose text says ``method``."""
    return isinstance(node, ast.Name | ast.Attribute | ast.Subscript | ast.Call) and "method" in ast.unparse(node).lower()


def _stands_for_a_method(constant: ast.Constant, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether an ordinary word is used as a method's name: compared with, passed as, defaulted
    to or collected (in a tuple, list, set or dict) under something named ``method``; the words
    of ``LISTS_ONLY`` only where collected."""
    node: ast.AST = constant
    while isinstance(parents.get(node), ast.Tuple | ast.List | ast.Set | ast.Dict):
        node = parents[node]
    if node is constant and constant.value in LISTS_ONLY:
        return False
    parent = parents.get(node)
    if isinstance(parent, ast.Compare):
        return any(_named_method(side) for side in (parent.left, *parent.comparators))
    if isinstance(parent, ast.keyword):
        return parent.arg is not None and "method" in parent.arg.lower()
    if isinstance(parent, ast.Assign | ast.AnnAssign):
        targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
        return any("method" in ast.unparse(target).lower() or "planner" in ast.unparse(target).lower()
                   for target in targets)
    if isinstance(parent, ast.arguments):
        positional = [*parent.posonlyargs, *parent.args]
        pairs = list(zip(positional[len(positional) - len(parent.defaults):], parent.defaults, strict=True))
        pairs += [(arg, default) for arg, default in zip(parent.kwonlyargs, parent.kw_defaults, strict=True) if default]
        return any(default is node and "method" in arg.arg.lower() for arg, default in pairs)
    if isinstance(parent, ast.IfExp | ast.BoolOp):  # `x if cond else "none"` as a method's value
        grand = parents.get(parent)
        return isinstance(grand, ast.Compare | ast.Assign | ast.keyword) and "method" in ast.unparse(grand).lower()
    return False


def method_names_in(source: str) -> list[tuple[int, str]]:
    """(line, name) for each string constant of ``source`` that names a method, docstrings aside."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    docstrings = {
        id(node.body[0].value) for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and node.value in NAMES) or id(node) in docstrings:
            continue
        if node.value in ORDINARY_WORDS and not _stands_for_a_method(node, parents):
            continue
        found.append((node.lineno, node.value))
    return sorted(found)


def test_no_module_but_the_registry_names_a_method() -> None:
    stray = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module in OWN_MODULES:
            continue
        stray += [f"{module}:{line}: {name!r}" for line, name in method_names_in(path.read_text())
                  if (module, name) not in ALLOWED]
    assert not stray, ("method names outside core/registry.py (read them from the registry, or allow "
                       "one in tests/test_method_registry.py with its reason):\n" + "\n".join(stray))


def test_every_allowed_place_still_names_its_method() -> None:
    """An allow-list entry whose name has gone is removed, so the list only shrinks."""
    stale = [place for place in ALLOWED
             if place[1] not in {name for _, name in method_names_in((PACKAGE / place[0]).read_text())}]
    assert not stale, f"allowed places that no longer name their method: {stale}"


@pytest.mark.parametrize(("source", "expected"), [
    ('METHODS = ("none", "ngram", "medusa")', [(1, "medusa"), (1, "ngram"), (1, "none")]),
    ('if method == "auto": pass', [(1, "auto")]),
    ('if request.method in ("none", "draft"): pass', [(1, "draft"), (1, "none")]),
    ('PLANNERS = {"none": plan_plain}', [(1, "none")]),
    ('def f(method="auto"): pass', [(1, "auto")]),
    ('run(method="auto")', [(1, "auto")]),
    ('m = x.method if x.method in BATCH else "auto"', [(1, "auto")]),
    ('if method == "none": pass\nrun(method="draft")\ndef f(method="none"): pass', []),
    ('device = "auto"\nquant = "none"\nrole = "draft"', []),
    ('def f():\n    """Runs method "medusa"."""', []),
    ('heads = {"medusa": a}', [(1, "medusa")]),
])
def test_the_scan_finds_method_names_and_skips_ordinary_words(source: str, expected: list[tuple[int, str]]) -> None:
    assert method_names_in(source) == expected


def test_the_views_are_the_registry() -> None:
    """The tuples other code imports are read from the registry, in its order."""
    assert METHODS == tuple(spec.name for spec in registry.REGISTRY)
    assert TREE_METHODS == tuple(s.name for s in registry.REGISTRY if s.needs == registry.NEEDS_HEADS)
    assert DRAFT_MODEL_METHODS == tuple(s.name for s in registry.REGISTRY if s.uses_draft_model)
    assert BATCH_METHODS == tuple(s.name for s in registry.REGISTRY if s.batch)
    assert set(PLANNERS) == set(METHODS)
    # backends/select.py keeps its own copy (a file outside this change): it must agree.
    assert set(TORCH_ONLY_METHODS) == {s.name for s in registry.REGISTRY if s.backends == (TORCH,)}
    assert {TORCH, LLAMACPP} == set(registry.BACKENDS)


def test_each_entry_is_complete() -> None:
    for spec in registry.REGISTRY:
        assert spec.needs in registry.NEEDS, spec
        assert spec.drafts in registry.DRAFT_SHAPES, spec
        assert spec.planner in registry.PLANNER_KINDS, spec
        assert spec.backends and set(spec.backends) <= set(registry.BACKENDS), spec
        assert spec.description and "\n" not in spec.description, spec
    assert len(set(registry.METHODS)) == len(registry.METHODS)
