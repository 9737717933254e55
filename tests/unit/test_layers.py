"""Layers that point one way (docs/design.md "Layers"): every module of the product has one layer, and
imports only its own layer and those below it, without cycles and without imports inside functions
(but for the CLI's entry point, which imports its subcommands when one is run).

The import graph is read from the source with `ast`: every import, at module level or in a function,
of servestack/, operations/, facts/ and the pyinfra entry files. The test harness (sandbox/) is not
part of any layer: it may import anything, and nothing in the product may import it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("servestack", "operations", "facts")
ENTRY_FILES = ("deploy.py", "rollback.py", "config.py", "inventory.py")
HARNESS = ("sandbox", "servestack.sandbox", "servestack.rehearse")
PROJECT_ROOTS = {*PACKAGES, *(name.removesuffix(".py") for name in ENTRY_FILES), "sandbox"}

LAYERS = {
    # L0 the model: stdlib, packaging, tomllib and each other; no pyinfra, no host access
    0: ("servestack", "servestack.errors", "servestack.manifest", "servestack.values", "servestack.keys",
        "servestack.strict_keys", "servestack.profiles", "servestack.settings", "servestack.targets",
        "servestack.patchlib", "servestack.hostcode", "servestack.patchsets", "servestack.paths", "servestack.releases",
        "servestack.serving", "servestack.speculation_policy", "servestack.stack_hashes", "servestack.checks.outcome",
        "servestack.weights"),
    # L1 facts and host-side code: what reads a host and runs commands there, and the checks' judges
    1: ("facts", "facts.batch", "facts.framing", "facts.gpu", "facts.host", "facts.patches", "facts.preflight",
        "facts.service", "facts.toolkit", "facts.venv", "facts.verify", "facts.weights",
        "servestack.hostrun", "servestack.reads", "servestack.scripts", "servestack.pyinfra_hooks",
        "servestack.download", "servestack.runreport",
        "servestack.checks", "servestack.checks.catalogue", "servestack.checks.gpus", "servestack.checks.parse",
        "servestack.checks.readings", "servestack.checks.release", "servestack.checks.service",
        "servestack.checks.toolkit", "servestack.checks.weights"),
    # L2 operations: the steps
    2: ("operations", "operations.patches", "operations.preflight", "operations.prestart", "operations.service",
        "operations.speculation", "operations.toolkit", "operations.venv", "operations.verify", "operations.weights"),
    # L3 entry points: what pyinfra and the CLI run
    3: ("deploy", "rollback", "config", "inventory", "servestack.cli", "servestack.doctor", "servestack.status",
        "servestack.verify", "servestack.bench", "servestack.backups", "servestack.preconnect", "servestack.fleet",
        "servestack.run_checks"),
}
LAYER_OF = {module: layer for layer, modules in LAYERS.items() for module in modules}
MAY_IMPORT_IN_FUNCTIONS = {"servestack.cli"}   # the entry point imports its subcommand's module when it runs
@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    in_function: bool


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_files(root: Path = ROOT) -> dict[str, Path]:
    files = [path for package in PACKAGES for path in sorted((root / package).rglob("*.py"))]
    files += [root / name for name in ENTRY_FILES if (root / name).exists()]
    modules = {module_name(path, root): path for path in files}
    return {name: path for name, path in modules.items() if not is_harness(name)}


def is_harness(name: str) -> bool:
    return any(name == harness or name.startswith(harness + ".") for harness in HARNESS)


def is_project(name: str) -> bool:
    return name.split(".")[0] in PROJECT_ROOTS


def resolve(name: str, modules: dict[str, Path]) -> str:
    """The module an imported name lands in: itself, or the longest prefix that is a module (the
    harness's own modules are not read: their names stand as written)."""
    if is_harness(name):
        return name
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return name


def imported_modules(node: ast.Import | ast.ImportFrom, source: str, is_package: bool,
                     modules: dict[str, Path]) -> list[str]:
    """The modules an import statement of `source` loads: `from m import n` loads m.n when that is a
    module, else m."""
    if isinstance(node, ast.Import):
        return [resolve(alias.name, modules) for alias in node.names]
    base = node.module or ""
    if node.level:
        package = source.split(".") if is_package else source.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join([*package, *([base] if base else [])])
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else resolve(base, modules)
            for alias in node.names]


class _Imports(ast.NodeVisitor):
    def __init__(self, source: str, is_package: bool, modules: dict[str, Path]):
        self.source, self.is_package, self.modules = source, is_package, modules
        self.found: list[Import] = []
        self.depth = 0

    def _function(self, node) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _import(self, node) -> None:
        for target in imported_modules(node, self.source, self.is_package, self.modules):
            if is_project(target):
                self.found.append(Import(self.source, target, node.lineno, self.depth > 0))

    visit_Import = visit_ImportFrom = _import


def import_graph(root: Path = ROOT) -> tuple[dict[str, Path], list[Import]]:
    modules = product_files(root)
    imports = []
    for name, path in modules.items():
        visitor = _Imports(name, path.name == "__init__.py", modules)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        imports += [found for found in visitor.found if found.target != name]
    return modules, imports


def layer_problems(modules: dict[str, Path], imports: list[Import]) -> list[str]:
    problems = [f"{name} has no layer: add it to LAYERS in tests/unit/test_layers.py"
                for name in modules if name not in LAYER_OF]
    problems += [f"{name} is in LAYERS but no such module exists" for name in LAYER_OF if name not in modules]
    for found in imports:
        edge = f"{found.source} -> {found.target}"
        if is_harness(found.target):
            problems.append(f"{edge}: the product imports the test harness")
        elif found.target not in modules:
            problems.append(f"{edge}: no such module of the product")
        elif found.source in LAYER_OF and found.target in LAYER_OF \
                and LAYER_OF[found.target] > LAYER_OF[found.source]:
            problems.append(f"{edge}: L{LAYER_OF[found.source]} imports L{LAYER_OF[found.target]}")
    return sorted(set(problems))


def cycles(imports: list[Import]) -> list[list[str]]:
    """The import cycles: each strongly connected group of two or more modules (Tarjan), sorted."""
    graph: dict[str, set[str]] = {}
    for found in imports:
        graph.setdefault(found.source, set()).add(found.target)
        graph.setdefault(found.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def in_function_problems(imports: list[Import]) -> list[str]:
    return sorted({f"{found.source} -> {found.target} (line {found.line}): a project import inside a function"
                   for found in imports if found.in_function and found.source not in MAY_IMPORT_IN_FUNCTIONS})


def test_every_module_has_one_layer_and_imports_point_down():
    problems = layer_problems(*import_graph())
    assert not problems, "\n".join(problems)


def test_the_import_graph_has_no_cycles():
    _, imports = import_graph()
    found = cycles(imports)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(group) for group in found)


def test_no_project_import_is_placed_inside_a_function():
    _, imports = import_graph()
    problems = in_function_problems(imports)
    assert not problems, "\n".join(problems)


def test_no_module_is_in_two_layers():
    listed = [module for modules in LAYERS.values() for module in modules]
    assert len(listed) == len(set(listed)), sorted({module for module in listed if listed.count(module) > 1})


def test_the_reading_sees_every_kind_of_violation(tmp_path):
    """The checks above on a small tree that breaks each rule once."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "servestack" / "errors.py").write_text("from servestack import bench\n")           # L0 -> L3
    (tmp_path / "servestack" / "bench.py").write_text("from . import errors\n"
                                                       "def main():\n    import operations.service\n")
    (tmp_path / "operations" / "service.py").write_text("import sandbox.lab\nfrom servestack import bench\n")
    (tmp_path / "facts" / "unlisted.py").write_text("")
    modules, imports = import_graph(tmp_path)
    problems = [problem for problem in layer_problems(modules, imports) if "no such module exists" not in problem]
    assert problems == [
        "facts.unlisted has no layer: add it to LAYERS in tests/unit/test_layers.py",
        "operations.service -> sandbox.lab: the product imports the test harness",
        "operations.service -> servestack.bench: L2 imports L3",
        "servestack.errors -> servestack.bench: L0 imports L3",
    ]
    assert cycles(imports) == [["operations.service", "servestack.bench", "servestack.errors"]]
    assert in_function_problems(imports) == [
        "servestack.bench -> operations.service (line 3): a project import inside a function"]
