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
