"""The import order of the layers (docs/ARCHITECTURE.md): each package imports only the
layers below it, so no two import each other; the scheduler's policies know nothing of
the engine or the serving layer; ``kernels/`` and ``client/`` stand alone. Within and
across layers no two modules import each other, and no module (the tests' too) passes
400 lines."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernels", "client", "preble_backend", "scheduler")
MAX_LINES = 400

# Each layer and the layers it may import, bottom to top; the rooms of preble_backend are
# the processes of ARCHITECTURE.md: the engine's Triton model (engine_server), the router's
# (router), the processes that run them (runtime), the front, the CLI, and the benchmarks.
BELOW_CLI = {"common", "client", "model", "engine", "scheduler", "scheduler.sim", "serving", "engine_server",
             "router", "runtime", "frontend", "kv_transfer"}  # fmt: skip
ALLOWED = {
    "kernels": set(),
    "common": set(),
    "client": {"common"},
    "model": {"common", "kernels"},
    "engine": {"common", "model", "kv_transfer"},
    "kv_transfer": {"common", "model"},
    "scheduler": {"common"},
    "scheduler.sim": {"common", "client", "model", "engine", "scheduler"},
    "serving": {"common", "model"},
    "engine_server": {"common", "model", "engine", "serving", "kv_transfer"},
    "router": {"common", "client", "model", "scheduler", "serving"},
    "runtime": {"common", "model", "engine", "serving", "router"},
    "frontend": {"common", "client", "model", "serving"},
    "benchmarks": {"kernels", *BELOW_CLI},
    "cli": {*BELOW_CLI, "benchmarks"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str | None:
    """The layer a dotted module name belongs to (None: not the project's)."""
    parts = module.split(".")
    if parts[0] in ("kernels", "client"):
        return parts[0]
    if parts[0] == "scheduler":
        return "scheduler.sim" if parts[1:2] == ["sim"] else "scheduler"
    if parts[0] == "preble_backend":
        return "cli" if parts[1:2] in (["cli"], []) else parts[1]
    return None


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function (``from package
    import name`` also as ``package.name``: it may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def layer_edges() -> dict[str, dict[str, set[str]]]:
    """layer -> imported layer -> the files that import it."""
    edges: dict[str, dict[str, set[str]]] = {name: {} for name in ALLOWED}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT)
            source = layer(module_name(path))
            for module in imports(path):
                target = layer(module)
                if target is not None and target != source:
                    edges[source].setdefault(target, set()).add(str(rel))
    return edges


def test_every_module_belongs_to_a_layer():
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            assert layer(module_name(path)) in ALLOWED, path


def test_layers_import_only_the_layers_below():
    edges = layer_edges()
    wrong = {
        f"{source} -> {target} ({', '.join(sorted(files))})"
        for source, targets in edges.items()
        for target, files in targets.items()
        if target not in ALLOWED[source]
    }
    assert not wrong


def test_no_two_layers_import_each_other():
    edges = layer_edges()
    try:
        list(TopologicalSorter({source: set(targets) for source, targets in edges.items()}).static_order())
    except CycleError as exc:
        raise AssertionError(f"import cycle between layers: {exc.args[1]}") from None


def module_imports() -> dict[str, set[str]]:
    """module -> the project's modules it imports (``from package import module`` too)."""
    files = {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
    return {name: {m for m in imports(path) if m in files and m != name} for name, path in files.items()}


def test_no_two_modules_import_each_other():
    """Not even for type checking: a circle says two modules are one concept or a third is missing."""
    graph = module_imports()
    try:
        list(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        raise AssertionError(f"import cycle between modules: {exc.args[1]}") from None


def test_no_module_passes_the_size_of_one_concept():
    """The tests' modules too: a test file is one behaviour's suite."""
    files = [path for package in (*PACKAGES, "tests") for path in (ROOT / package).rglob("*.py")]
    lines = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in files}
    long = {name: n for name, n in lines.items() if n > MAX_LINES}
    assert not long, long


# The rooms inside a layer, bottom to top (each package's docstring says what lives there):
# a room imports only the modules and rooms before it in its list (and itself).
ROOMS = {
    "preble_backend.engine": ["config", "cache", "outputs", "scheduling", "runners", "engine"],
    "preble_backend.router": ["config", "router_metrics", "engines", "requests", "cluster", "router_model"],
}


def test_every_module_of_a_layer_with_rooms_is_in_one():
    for package, rooms in ROOMS.items():
        folder = ROOT / package.replace(".", "/")
        paths = [path.relative_to(folder) for path in folder.rglob("*.py")]
        here = {path.parts[0].removesuffix(".py") for path in paths if path != Path("__init__.py")}
        assert here == set(rooms), (package, here ^ set(rooms))
        assert (folder / "__init__.py").read_text().startswith('"""'), f"{package} says what its rooms hold"
        for room in rooms:
            if (folder / room).is_dir():
                assert (folder / room / "__init__.py").read_text().startswith('"""'), f"{package}.{room}"


def test_rooms_import_only_the_rooms_below():
    graph = module_imports()
    wrong = []
    for package, rooms in ROOMS.items():

        def room(module: str, package: str = package) -> str | None:
            return module[len(package) + 1 :].split(".")[0] if module.startswith(package + ".") else None

        for module, targets in graph.items():
            source = room(module)
            for target in filter(None, map(room, targets)):
                if source is not None and rooms.index(target) > rooms.index(source):
                    wrong.append(f"{module} -> {package}.{target}")
    assert not wrong, wrong


def test_the_allowed_order_is_itself_a_layering():
    order = list(TopologicalSorter(ALLOWED).static_order())
    assert order.index("common") < order.index("scheduler") < order.index("serving") < order.index("cli")
    assert order.index("serving") < order.index("router") < order.index("runtime") < order.index("cli")
    assert not ALLOWED["kernels"] and ALLOWED["client"] == {"common"}
    assert ALLOWED["scheduler"] == {"common"}  # policies: no engine, no serving


def test_an_older_repositorys_entry_points_load_the_models_from_their_rooms(tmp_path):
    """A ``model.py`` written before the serving layer split (``preble_backend.serving.*``)
    imports the router and engine models from where they live now (``MOVED``), the same
    module objects; the Triton stub's ``pb_utils`` is a stand-in here."""
    import os
    import subprocess
    import sys

    (tmp_path / "triton_python_backend_utils.py").write_text(
        "def __getattr__(name):\n    return type(name, (), {})\n"
    )
    scenario = (
        "import preble_backend.serving.router_model as old_r, preble_backend.router.router_model as r\n"
        "import preble_backend.serving.engine_model as old_e\n"
        "import preble_backend.engine_server.engine_model as e\n"
        "assert old_r is r and old_e is e and r.TritonPythonModel and e.TritonPythonModel\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    command = [sys.executable, "-c", scenario]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
