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


# --- Beside the package: the benchmarks, the device tooling and the studies ---------------------
#
# ``benchmarks/`` (what a user runs to time the library) and ``tools/`` (the device tooling) sit
# outside the package, which imports neither. They, the studies and the scripts reach the kernels
# through public names only: no ``_name`` of a ``primal_dual.kernels`` module (nor its private
# modules such as ``_common``), whether imported, read as an attribute or named in a string (as a
# compile job names the function it compiles). The kernels' own tests may.
REPO = PACKAGE.parent
OUTSIDE = ("benchmarks", "tools")
PUBLIC_NAMES_ONLY = ("benchmarks", "tools", "reproduce", "scripts")
KERNELS = "primal_dual.kernels"


def _is_private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


def imports_of_outside(source: str) -> list[str]:
  """The modules of ``OUTSIDE`` a module's source imports, wherever the statement stands."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [node.module]
    else:
      continue
    found += [n for n in names if n.split(".")[0] in OUTSIDE]
  return found


def _private_kernel_path(path: str) -> str | None:
  """``path`` cut after its first private part when it reaches into the kernels, else None."""
  if not path.startswith(KERNELS + "."):
    return None
  parts = path.split(".")
  first = next((i for i, p in enumerate(parts) if _is_private(p)), None)
  return None if first is None else ".".join(parts[: first + 1])


def private_kernel_names() -> set[str]:
  """The private names the kernel modules define at their top level, and their private modules."""
  names = set()
  for path in (PACKAGE / "kernels").rglob("*.py"):
    if _is_private(path.stem):
      names.add(path.stem)
    for node in ast.parse(path.read_text()).body:
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        names.add(node.name)
      elif isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names.update(t.id for t in targets if isinstance(t, ast.Name))
  return {n for n in names if _is_private(n)}


def private_kernel_reaches(source: str, private_names: set[str]) -> list[str]:
  """Every reach of ``source`` into a private kernel name: imports, attributes of an imported
  kernel module, and string constants equal to a private name of ``private_names``."""
  tree = ast.parse(source)
  aliases, found = {}, []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        top = alias.name.split(".")[0]  # ``import a.b.c`` binds ``a``
        aliases[alias.asname or top] = alias.name if alias.asname else top
        found.append(_private_kernel_path(alias.name))
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for alias in node.names:
        aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        found.append(_private_kernel_path(f"{node.module}.{alias.name}"))
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and _is_private(node.attr):
      chain, inner = [node.attr], node.value
      while isinstance(inner, ast.Attribute):
        chain.append(inner.attr)
        inner = inner.value
      if isinstance(inner, ast.Name) and inner.id in aliases:
        found.append(_private_kernel_path(".".join([aliases[inner.id], *reversed(chain)])))
    elif isinstance(node, ast.Constant) and node.value in private_names:
      found.append(f"{KERNELS} name {node.value!r} in a string")
  return [f for f in found if f]


def test_the_scans_see_imports_of_outside_and_private_kernel_reaches():
  source = "def f():\n  from tools.device import lease\nimport benchmarks.common"
  assert sorted(imports_of_outside(source)) == ["benchmarks.common", "tools.device"]
  assert imports_of_outside("import toolsy\nfrom primal_dual import kernels") == []
  source = """
from primal_dual.kernels import _common
from primal_dual.kernels.hyla import tensorcore as ht, blockwise
import primal_dual.kernels.hyla.tensorcore
import primal_dual.kernels.hyla.tensorcore as t2
ht.forward_kernel.fn, ht._pad_heads, blockwise._tiles(1), t2._x.fn
primal_dual.kernels.hyla._private, primal_dual.kernels.hyla.tensorcore.Config
JOBS = {"forward": ("_secret_kernel", {}), "public": ("forward_kernel", {})}
"""
  assert sorted(private_kernel_reaches(source, {"_secret_kernel"})) == sorted(
    [
      "primal_dual.kernels._common",
      "primal_dual.kernels.hyla.tensorcore._pad_heads",
      "primal_dual.kernels.hyla.blockwise._tiles",
      "primal_dual.kernels.hyla.tensorcore._x",
      "primal_dual.kernels.hyla._private",
      "primal_dual.kernels name '_secret_kernel' in a string",
    ]
  )
  assert "_common" in private_kernel_names() and "forward_kernel" not in private_kernel_names()


def test_the_package_imports_neither_benchmarks_nor_tools():
  found = {
    str(path.relative_to(REPO)): imports
    for path in sorted(PACKAGE.rglob("*.py"))
    if (imports := imports_of_outside(path.read_text()))
  }
  assert found == {}


def test_benchmarks_tools_and_studies_use_public_kernel_names_only():
  private_names = private_kernel_names()
  paths = [p for folder in PUBLIC_NAMES_ONLY for p in sorted((REPO / folder).rglob("*.py"))]
  assert any(p.parts[-3:-1] == ("tools", "device") for p in paths)
  found = [
    f"{path.relative_to(REPO)}: {reach}"
    for path in paths
    for reach in private_kernel_reaches(path.read_text(), private_names)
  ]
  assert found == []
