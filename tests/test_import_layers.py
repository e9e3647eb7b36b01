"""The project's modules import one another without a loop, and only downward through its layers:
units → record → catalogs → trace/probes → reports → commands.

The graph is read from the source with ``ast``: every ``import`` and ``from ... import``, at the
top of a module or inside a function (a function-local import is still a dependency; it only runs
later). Imports under ``if TYPE_CHECKING:`` are annotations and not counted. An import of
``a.b.c`` runs the ``__init__`` of ``a`` and ``a.b`` too; those implicit edges are not counted, so
a package's ``__init__`` that re-exports its modules does not tie each of them to the others.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO_ROOT

#: Where each installed package's modules live in the repository.
PACKAGE_ROOTS = {
    "diagnose": REPO_ROOT / "diagnose",
    "diagnose.probes": REPO_ROOT / "probes",
    "diagnose.reports": REPO_ROOT / "reports",
}

#: The layers, lowest first. A module belongs to the layer of its longest matching prefix
#: (``diagnose`` itself matches only the package's own ``__init__``). A module may import from its
#: own layer or a lower one, never a higher one.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # How numbers are written, and the errors every layer raises.
    ("units", ("diagnose", "diagnose.units", "diagnose.errors")),
    # The record and what reads, writes, grades and redacts it.
    (
        "record",
        (
            "diagnose.record",
            "diagnose.record_io",
            "diagnose.verdicts",
            "diagnose.stats",
            "diagnose.contention",
            "diagnose.redact",
            "diagnose.secret_shapes",
            "diagnose.output",
            "diagnose.user_cache",
            "diagnose.roofline.model",
        ),
    ),
    # What the project knows about each concern: ids, thresholds, wording, fixes.
    (
        "catalogs",
        (
            "diagnose.catalogs",
            "diagnose.trainers",
            "diagnose.carry_over",
            "diagnose.attention_paths",
        ),
    ),
    # Measuring and reading: the workload, the capture, the probes, the trace analysis.
    (
        "trace/probes",
        (
            "diagnose.trace",
            "diagnose.probes",
            "diagnose.roofline",
            "diagnose.workload",
            "diagnose.capture",
            "diagnose.device",
            "diagnose.inventory",
            "diagnose.telemetry",
            "diagnose.strict",
            "diagnose.distributed",
            "diagnose.profile",
            "diagnose.sweep",
            "diagnose.bf16_hardware",
            "diagnose.probes.environment.facts",
            "diagnose.precision_policy",
            "diagnose.quantized_base",
            "diagnose.torch_compat",
            "diagnose.config",
            "diagnose.timing",
            "diagnose.sampling",
            "diagnose.offline",
            "diagnose.quiet",
            "diagnose.interrupts",
            "diagnose.entry",
            "diagnose.progress",
        ),
    ),
    # Rendering a record, and the CI gate's comparison of records.
    ("reports", ("diagnose.reports", "diagnose.gate")),
    # The commands and the orchestration behind them.
    (
        "commands",
        (
            "diagnose.commands",
            "diagnose.cli",
            "diagnose.__main__",
            "diagnose.run",
            "diagnose.finish",
            "diagnose.distributed.run_ranks",
            "diagnose.distributed.launch",
            "diagnose.distributed.worker",
            "diagnose.profile.finish",
        ),
    ),
)


def project_modules() -> dict[str, Path]:
    """Every module of the installed packages, by dotted name."""
    modules: dict[str, Path] = {}
    for package, root in PACKAGE_ROOTS.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _annotation_only(tree: ast.Module) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:``."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped.update(id(n) for n in ast.walk(child))
    return skipped


def _imported(
    module: str, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]
) -> list[str]:
    """The dotted names one import statement of ``module`` reaches (a ``from p import name`` reaches
    ``p.name`` when that is a module, else ``p``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".")
        if modules[module].name != "__init__.py":
            parts = parts[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join([*parts, *([node.module] if node.module else [])])
    names = [f"{base}.{alias.name}" for alias in node.names]
    return [name if name in modules else base for name in names]


def import_graph() -> dict[str, set[str]]:
    """For each project module, the project modules it imports (top level or in a function)."""
    modules = project_modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = _annotation_only(tree)
        targets: set[str] = set()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in skipped:
                continue
            for name in _imported(module, node, modules):
                while name not in modules and "." in name:
                    name = name.rsplit(".", 1)[0]
                if name in modules and name != module:
                    targets.add(name)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
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
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or (prefix != "diagnose" and module.startswith(prefix + "."))
            if matches and (best is None or len(prefix) > best[1]):
                best = (rank, len(prefix))
    return None if best is None else best[0]


def test_no_import_loop() -> None:
    graph = import_graph()
    loops = cycles(graph)
    described = [
        " ; ".join(f"{m} -> {', '.join(sorted(graph[m] & set(loop)))}" for m in loop)
        for loop in loops
    ]
    assert not loops, "import loops:\n" + "\n".join(described)


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(m for m in project_modules() if layer_of(m) is None)
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"


def test_imports_only_go_down_the_layers() -> None:
    graph = import_graph()
    upward = []
    for module, targets in sorted(graph.items()):
        mine = layer_of(module)
        for target in sorted(targets):
            theirs = layer_of(target)
            if mine is not None and theirs is not None and theirs > mine:
                upward.append(f"{module} ({LAYERS[mine][0]}) -> {target} ({LAYERS[theirs][0]})")
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


def test_the_reading_sees_a_loop_and_a_function_local_import(tmp_path: Path) -> None:
    source = "def f():\n    from diagnose.record import RunRecord\n"
    tree = ast.parse(source)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    modules = {"diagnose.units": tmp_path / "units.py", "diagnose.record": tmp_path / "record.py"}
    assert _imported("diagnose.units", node, modules) == ["diagnose.record"]
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert layer_of("diagnose.reports.view") > layer_of("diagnose.units")  # type: ignore[operator]


def test_one_pure_probe_module_imports_no_probe_and_no_torch() -> None:
    """A concern package's ``__init__`` is empty, and so is the probes package's: the report and
    the gate can read a probe's pure facts without importing every probe and torch."""
    import subprocess
    import sys

    code = (
        "import sys, diagnose.probes.environment.facts\n"
        "probes = sorted(m for m in sys.modules if m.startswith('diagnose.probes'))\n"
        "print('torch' in sys.modules, probes)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT
    ).stdout
    assert out.strip() == (
        "False ['diagnose.probes', 'diagnose.probes.environment', "
        "'diagnose.probes.environment.facts']"
    ), out
