"""The import graph of src/specdecode: no module imports one that imports it back, directly or
through others, and no package does either (every import counts: module level, inside functions
and under TYPE_CHECKING). Run `python -m pytest tests/test_import_graph.py -q` to see the cycles
after a change.

At package level each subpackage of specdecode is one node, each top-level module (config, api,
errors, loading, prompt_sets) another, and the package's own __init__ ("specdecode") a third
kind. The packages stand on floors, bottom first (``FLOORS``); a module imports from its own
package and from lower floors only:

    errors < core < config, prompt_sets < kv, quant < models < backends < costs < drafters
    < engine < loading < api < specdecode (the public names) < audit, bench, serving, training
    < cli

``core`` is the ground floor: device, sampling, token trees and their masks, timing, the method
registry; it imports nothing but itself and ``errors``.
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def import_graph() -> dict[str, set[str]]:
    modules = {}
    for path in (SRC / "specdecode").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_the_import_graph_has_no_cycle() -> None:
    found = [sorted(c) for c in cycles(import_graph())]
    assert not found, f"import cycles: {found}"


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_the_bench_is_a_leaf() -> None:
    """Nothing but the bench itself and its command imports specdecode.bench: the library, the
    server, training and the audit work without it (issue 28)."""
    graph = import_graph()
    bench = {name for name in graph if name == "specdecode.bench" or name.startswith("specdecode.bench.")}
    users = {name for name, targets in graph.items() if targets & bench and name not in bench}
    assert users == {"specdecode.cli.bench"}, f"modules outside the bench that import it: {sorted(users)}"


# The floors, bottom first. A package imports only from its own modules and from lower floors; the
# packages of one floor import nothing from each other. A new package takes a floor here.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("core",),  # the ground floor: the primitives every package imports
    ("config", "prompt_sets"),  # what a user asks for; the prompt sets
    ("kv", "quant"),  # KV caches; quantized weights and their kernels
    ("models",),  # the transformer, its heads, the loaders
    ("backends",),  # where passes run
    ("costs",),  # pass costs and draft-length policies
    ("drafters",),  # one drafter per file, the planner and its plans
    ("engine",),  # the decode loops
    ("loading",),
    ("api",),
    ("specdecode",),  # the package's __init__: the public names
    ("audit", "bench", "serving", "training"),
    ("cli",),
)


def package_of(module: str) -> str:
    """specdecode.engine.batch -> engine, specdecode.config -> config, specdecode -> specdecode."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """(importing package, imported package) -> the module imports behind that edge."""
    edges: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for module, targets in graph.items():
        for target in targets:
            if package_of(module) != package_of(target):
                edges.setdefault((package_of(module), package_of(target)), []).append((module, target))
    return edges


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {package_of(module): set() for module in graph}
    for source, target in package_edges(graph):
        packages[source].add(target)
    return packages


def test_the_packages_have_no_cycle() -> None:
    found = [sorted(c) for c in cycles(package_graph(import_graph()))]
    assert not found, f"package cycles: {found} (tests/test_import_graph.py's FLOORS: which import points up?)"


def test_each_package_imports_only_from_the_floors_below_it() -> None:
    floor = {package: level for level, packages in enumerate(FLOORS) for package in packages}
    graph = import_graph()
    unplaced = sorted(set(package_graph(graph)) - set(floor))
    assert not unplaced, f"packages with no floor in FLOORS: {unplaced}"
    upward = sorted(
        f"{module} -> {target}"
        for (source, imported), pairs in package_edges(graph).items()
        if floor[imported] >= floor[source]
        for module, target in pairs
    )
    assert not upward, "imports from a package's own floor or above it:\n" + "\n".join(upward)


def test_the_ground_floor_imports_nothing_above_it() -> None:
    """specdecode.core imports only its own modules and specdecode.errors: never config, the
    engine or a backend, even for a type (name what it needs of them as a Protocol)."""
    graph = import_graph()
    core = {name for name in graph if package_of(name) == "core"}
    assert "specdecode.core.device" in core and "specdecode.core.sampling" in core
    above = sorted(f"{module} -> {target}" for module in core for target in graph[module]
                   if package_of(target) not in ("core", "errors"))
    assert not above, f"the ground floor imports from above it: {above}"


def test_the_floor_check_finds_an_upward_import() -> None:
    graph = {"specdecode.core.tree": {"specdecode.kv.static"}, "specdecode.kv.static": set()}
    assert package_edges(graph) == {("core", "kv"): [("specdecode.core.tree", "specdecode.kv.static")]}
    assert cycles(package_graph({**graph, "specdecode.kv.static": {"specdecode.core.device"},
                                 "specdecode.core.device": set()})) == [{"core", "kv"}]
