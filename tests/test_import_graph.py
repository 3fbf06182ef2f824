"""The package's modules import each other without cycles (function-level imports included)."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "primal_dual"


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(tree: ast.AST, known: set[str]) -> set[str]:
  """The package modules a module's source imports, wherever the import statement stands."""
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    else:
      continue
    found.update(name for name in names if name in known)
  return found


def import_graph() -> dict[str, set[str]]:
  paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
  known = set(paths)
  graph = {}
  for name, path in paths.items():
    imports = _imported(ast.parse(path.read_text()), known)
    # A package's __init__ importing its own submodules is not a dependency between peers.
    graph[name] = {m for m in imports if m != name and not m.startswith(name + ".")}
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One cycle as a list of modules (first = last), or None."""
  state: dict[str, int] = {}  # 1: on the current path, 2: finished
  path: list[str] = []

  def visit(node):
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        return path[path.index(nxt) :] + [nxt]
      if nxt not in state:
        cycle = visit(nxt)
        if cycle:
          return cycle
    state[node] = 2
    path.pop()
    return None

  for node in sorted(graph):
    if node not in state:
      cycle = visit(node)
      if cycle:
        return cycle
  return None


def test_finder_sees_a_cycle():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_package_has_no_import_cycle():
  graph = import_graph()
  assert "primal_dual.registry" in graph and "primal_dual.data.builders" in graph
  assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


# The package's layers, lowest first: a module imports only modules of its own layer or below.
# The trainer finds a task by name (``importlib``), never by an import statement, so the tasks can
# sit above it; the command-line code sits on top. The studies of ``reproduce/`` are outside the
# package and may import any of it.
LAYERS = (
  ("primal_dual.atomic", "primal_dual.kernels"),
  ("primal_dual.registry",),
  ("primal_dual._attend", "primal_dual._decode"),
  ("primal_dual.layers", "primal_dual.nnx"),
  ("primal_dual.models",),
  ("primal_dual.data",),
  ("primal_dual.training",),
  ("primal_dual.analysis",),
  ("primal_dual.configs",),
  ("primal_dual.tasks",),
  ("primal_dual.commands", "primal_dual.__main__"),
)
# The package's own __init__ re-exports the library (kernels, layers, nnx) and imports no higher.
PACKAGE_INIT = "primal_dual"


def layer_of(module: str) -> int:
  for level, prefixes in enumerate(LAYERS):
    if any(module == p or module.startswith(p + ".") for p in prefixes):
      return level
  raise KeyError(f"{module} is in no layer: add it to LAYERS")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
  """``importer -> imported`` for every import of a higher layer."""
  found = []
  for module, imports in sorted(graph.items()):
    if module == PACKAGE_INIT:
      continue
    for imported in sorted(imports):
      if imported != PACKAGE_INIT and layer_of(imported) > layer_of(module):
        found.append(f"{module} -> {imported}")
  return found


def task_to_task_imports(graph: dict[str, set[str]]) -> list[str]:
  """Imports between two task modules (what tasks share lives in ``primal_dual.tasks._*``)."""

  def is_task(name):
    return name.startswith("primal_dual.tasks.") and not name.rpartition(".")[2].startswith("_")

  return [
    f"{module} -> {imported}"
    for module, imports in sorted(graph.items())
    if is_task(module)
    for imported in sorted(imports)
    if is_task(imported)
  ]


def test_the_checks_see_upward_and_task_to_task_imports():
  graph = {
    "primal_dual.training.trainer": {"primal_dual.configs.sraven"},
    "primal_dual.tasks.logic": {"primal_dual.tasks.sraven", "primal_dual.tasks._common"},
    "primal_dual.tasks.sraven": {"primal_dual.training.trainer"},
  }
  assert upward_imports(graph) == ["primal_dual.training.trainer -> primal_dual.configs.sraven"]
  assert task_to_task_imports(graph) == ["primal_dual.tasks.logic -> primal_dual.tasks.sraven"]


def test_every_module_has_a_layer():
  for module in import_graph():
    if module != PACKAGE_INIT:
      layer_of(module)


def test_no_module_imports_a_higher_layer():
  assert upward_imports(import_graph()) == []


def test_no_task_imports_another_task():
  assert task_to_task_imports(import_graph()) == []
