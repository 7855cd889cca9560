"""Apps depend downward only, in DESIGN.md's layers (stated below as data), and no modules
import each other around a loop. Read from the source with every import counted,
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


# DESIGN.md's layers, the top first: an app imports only from the layers below its own, never a
# sibling's, and no `ready()` hands calls back up. Two places differ from the card's line, as the
# code needs: approvals carry out an approved change of degradation tiers (so sit above them, not
# beside incidents), and the audit trail writes through the database helpers of the base (web).
LAYERS: list[set[str]] = [
    {"devtools"},  # the local fleet, simulator, load generator, seeding: no product app's
    {"api"},  # the JSON API and the self-metrics exporter: they read every app
    {"statefiles"},  # each pool's desired state as files: applied through every app's services
    {"retention"},
    {"approvals"},
    {"scaling"},  # the nodes each pool needs: it reads what runs on a pool, changes none of it
    {"degradation"},
    {"incidents"},
    {"rollouts"},
    {"performance"},  # perf_analyzer's runs and searches, drawn as the observability pages draw
    {"quality", "observability"},
    {"fleet"},
    {"registry"},
    {"accounts"},
    {"audit"},
    {"web", "prometheus"},  # the base: imports no app
]
RANK = {app: depth for depth, layer in enumerate(LAYERS) for app in layer}
PROJECT = Path(__file__).parents[2] / "controlplane"
# The project package: settings, urls, celery, health, logs, wsgi/asgi (and env, settings' own).
PROJECT_MODULES = {
    "__init__",
    "settings",
    "env",
    "urls",
    "celery",
    "health",
    "logs",
    "wsgi",
    "asgi",
}
PROJECT_MAX_LINES = 800


def test_every_app_has_its_layer() -> None:
    apps = {path.parent.name for path in APPS.glob("*/apps.py")}
    assert apps == set(RANK), f"in no layer: {apps - set(RANK)}; gone: {set(RANK) - apps}"


def test_apps_import_only_from_the_layers_below_their_own() -> None:
    found = imports()
    assert any(app == "api" for app, _, _ in found), "the walk saw no imports at all"
    upward = [
        f"{where} ({app}, layer {RANK[app]}) imports {name} (layer {RANK[_app(name)]})"
        for app, where, name in found
        if RANK[_app(name)] <= RANK[app]
    ]
    assert not upward, "\n".join(upward)


def test_the_project_package_holds_the_project_only_and_no_app_imports_it() -> None:
    modules = {path.stem for path in PROJECT.glob("*.py")}
    assert modules <= PROJECT_MODULES, f"not the project's: {sorted(modules - PROJECT_MODULES)}"
    lines = sum(len(path.read_text().splitlines()) for path in PROJECT.glob("*.py"))
    assert lines < PROJECT_MAX_LINES, lines
    found = [
        f"{path.relative_to(APPS.parent)}:{line} imports {name}"
        for path in sorted(APPS.glob("**/*.py"))
        for line, name in _absolute(path)
        if name.split(".")[0] == "controlplane"
    ]
    assert not found, "\n".join(found)


def test_no_app_hands_calls_back_up_from_ready() -> None:
    """An AppConfig.ready() may connect the framework's signals, and nothing else: a list that
    an app above fills at start-up is an upward import in disguise."""
    found = []
    for path in sorted(APPS.glob("*/apps.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef) and node.name == "ready":
                found += [
                    f"{path.relative_to(APPS.parent)}:{call.lineno} {ast.unparse(call.func)}"
                    for call in ast.walk(node)
                    if isinstance(call, ast.Call)
                    and not (isinstance(call.func, ast.Attribute) and call.func.attr == "connect")
                ]
    assert not found, "\n".join(found)


def test_only_the_browser_tests_import_playwright() -> None:
    """tests/e2e, the browser benchmarks (marked e2e) and their helpers: a unit test run never
    loads a browser's driver."""
    root = APPS.parent
    helpers = {root / "tests" / "support" / name for name in ("browser.py", "browser_fixtures.py")}
    found = [
        f"{path.relative_to(root)}:{line}"
        for folder in ("apps", "controlplane", "tests")
        for path in sorted((root / folder).glob("**/*.py"))
        if not ("e2e" in path.parts or path in helpers or "pytest.mark.e2e" in path.read_text())
        for line, name in _absolute(path)
        if name.split(".")[0] in ("playwright", "axe_playwright_python")
    ]
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
