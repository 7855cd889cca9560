"""Apps depend downward only (DESIGN.md): the audit trail imports no other app, and neither apps
nor modules import each other around a loop. Read from the source with every import counted,
those inside functions too: deferring an import hides a cycle from Python, not from the
design."""

import ast
from pathlib import Path

APPS = Path(__file__).parents[2] / "apps"


def _app(module: str) -> str:
    """`audit` for `apps.audit.models.AuditEvent`; "" for a module outside the apps."""
    parts = module.split(".")
    return parts[1] if parts[0] == "apps" and len(parts) > 1 else ""


def imports(*, within_apps: bool = False) -> list[tuple[str, str, str]]:
    """(importing app, its module:line, imported module) of every import of one app by another,
    or of one module of the apps by another (`within_apps`)."""
    found = []
    for path in sorted(APPS.glob("*/**/*.py")):
        parts = path.relative_to(APPS.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                # `from .x import y` counts from the package: parts[:-1], of a module and of an
                # __init__ alike.
                package = parts[: len(parts) - node.level] if node.level else ()
                base = ".".join([*package, *([node.module] if node.module else [])])
                names = (
                    [f"{base}.{alias.name}" for alias in node.names] if base == "apps" else [base]
                )
            else:
                continue
            for name in names:
                if _app(name) not in ("", parts[1]) or (within_apps and _app(name)):
                    found.append((parts[1], f"{module}:{node.lineno}", name))
    return found


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for after in graph[todo.pop()] - seen:
            seen.add(after)
            todo.append(after)
    return seen


BASE = Path(__file__).parents[2] / "controlplane"
# controlplane's modules that set the project up and so see every app; the rest are the base
# every app may import (web helpers, the Prometheus client and its query catalog), and import
# no app.
TOP = {"settings", "urls", "celery", "asgi", "wsgi", "metrics", "logs"}


def test_the_audit_trail_imports_no_other_app() -> None:
    found = [f"{where} imports {name}" for app, where, name in imports() if app == "audit"]
    assert not found, "\n".join(found)


def _absolute(path: Path) -> list[tuple[int, str]]:
    """(line, module) of each absolute import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.append((node.lineno, node.module or ""))
    return found


def test_the_base_imports_no_app() -> None:
    found = []
    for path in sorted(BASE.glob("*.py")):
        if path.stem in TOP:
            continue
        found += [
            f"controlplane/{path.name}:{line} imports {n}" for line, n in _absolute(path) if _app(n)
        ]
    assert not found, "\n".join(found)
    assert (BASE / "prometheus.py").exists() and (BASE / "catalog.py").exists()


def test_no_product_app_imports_the_tooling() -> None:
    """The local fleet, the simulator, the load generator and the seeding are for the demo,
    the tests and the benchmarks: what runs in production never needs them."""
    found = [
        f"{where} imports {name}" for app, where, name in imports() if _app(name) == "devtools"
    ]
    assert not found, "\n".join(found)
    assert any(app == "devtools" for app, _, _ in imports()), "the walk saw no tooling"


def test_no_apps_import_each_other_around_a_loop() -> None:
    found = imports()
    graph: dict[str, set[str]] = {path.parent.name: set() for path in APPS.glob("*/apps.py")}
    for app, _, name in found:
        graph[app].add(_app(name))
    assert graph["api"], "the walk saw no imports at all"
    reach = {app: _reach(graph, app) for app in graph}
    # Strongly connected components: the apps each app reaches and is reached from.
    cycles = {frozenset({a, *(b for b in reach[a] if a in reach[b])}) for a in reach}
    report = [
        f"apps {', '.join(sorted(cycle))} import each other:\n"
        + "\n".join(
            f"  {app} -> {other}: "
            + ", ".join(where for by, where, name in found if (by, _app(name)) == (app, other))
            for app in sorted(cycle)
            for other in sorted(graph[app] & cycle)
        )
        for cycle in sorted(cycles, key=sorted)
        if len(cycle) > 1
    ]
    assert not report, "\n".join(report)


def _modules() -> set[str]:
    return {
        ".".join(path.relative_to(APPS.parent).with_suffix("").parts).removesuffix(".__init__")
        for path in APPS.glob("**/*.py")
    }


def test_no_modules_import_each_other_around_a_loop() -> None:
    modules = _modules()
    graph: dict[str, set[str]] = {module: set() for module in modules}
    for _, where, name in imports(within_apps=True):
        importer = where.split(":")[0]
        # `from apps.fleet.models import Node` names a module's attribute: its module counts.
        target = name if name in modules else name.rpartition(".")[0]
        if target in modules and target != importer:
            graph[importer].add(target)
    assert graph["apps.fleet.tasks"], "the walk saw no imports between modules"
    reach = {module: _reach(graph, module) for module in graph}
    loops = {
        " <-> ".join(sorted(other for other in reach[module] if module in reach[other]))
        for module in graph
        if module in reach[module]
    }
    assert not loops, "modules that import each other:\n" + "\n".join(sorted(loops))


def test_no_test_imports_another_test_module() -> None:
    """What tests share lives in tests/support (helpers) and conftest.py (fixtures)."""
    tests = Path(__file__).parents[1]
    found = []
    for path in sorted(tests.glob("**/*.py")):
        layers = ("tests.unit", "tests.integration", "tests.e2e", "tests.bench")
        found += [
            f"{path.relative_to(tests)}:{line} {n}"
            for line, n in _absolute(path)
            if n.startswith(layers)
        ]
    assert not found, "\n".join(found)


MAX_MODULE_LINES = 500


def test_no_module_of_the_apps_is_longer_than_a_reader_can_hold() -> None:
    """A module past MAX_MODULE_LINES holds more than one room's worth: split it by what it does
    (migrations, generated, aside)."""
    long = {
        str(path.relative_to(APPS)): lines
        for path in APPS.glob("*/**/*.py")
        if "migrations" not in path.parts
        and (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, long
