"""Size limits of the training package, read from its source with `ast`: no function longer than
`MAX_FUNCTION_LINES`, no record (dataclass or NamedTuple) with more than `MAX_RECORD_FIELDS`
fields. They keep the trainer readable (a function on one screen, a record one can hold in mind);
a change that needs more splits the function or the record instead."""

import ast
import pathlib

import pytest

TRAINING = pathlib.Path(__file__).resolve().parents[1] / "primal_dual" / "training"
MAX_FUNCTION_LINES = 80
MAX_RECORD_FIELDS = 16


def _trees() -> dict[str, ast.Module]:
  return {path.name: ast.parse(path.read_text()) for path in sorted(TRAINING.glob("*.py"))}


def function_lengths(tree: ast.Module) -> dict[str, int]:
  """Lines (decorators and docstring included) of every function and method, by name."""
  return {
    node.name: node.end_lineno - min([node.lineno] + [d.lineno for d in node.decorator_list]) + 1
    for node in ast.walk(tree)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
  }


def _is_record(node: ast.ClassDef) -> bool:
  def name(expr) -> str:
    expr = expr.func if isinstance(expr, ast.Call) else expr
    return expr.attr if isinstance(expr, ast.Attribute) else getattr(expr, "id", "")

  return any(name(d) == "dataclass" for d in node.decorator_list) or any(
    name(base) == "NamedTuple" for base in node.bases
  )


def record_widths(tree: ast.Module) -> dict[str, int]:
  """Fields (annotated class attributes) of every dataclass and NamedTuple, by name."""
  return {
    node.name: sum(
      isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) for item in node.body
    )
    for node in ast.walk(tree)
    if isinstance(node, ast.ClassDef) and _is_record(node)
  }


def test_the_measures_see_long_functions_and_wide_records():
  fields = "\n".join(f"  f{i}: int" for i in range(MAX_RECORD_FIELDS + 1))
  body = "\n".join(f"  x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
  tree = ast.parse(
    f"@dataclasses.dataclass\nclass Wide:\n{fields}\n\n"
    f"class Pair(NamedTuple):\n  a: int\n  b: int\n\n"
    f"@decorated\ndef long():\n{body}\n"
  )
  assert record_widths(tree) == {"Wide": MAX_RECORD_FIELDS + 1, "Pair": 2}
  assert function_lengths(tree) == {"long": MAX_FUNCTION_LINES + 2}


@pytest.mark.parametrize("module", sorted(path.name for path in TRAINING.glob("*.py")))
def test_training_functions_and_records_stay_small(module):
  tree = _trees()[module]
  long = {name: n for name, n in function_lengths(tree).items() if n > MAX_FUNCTION_LINES}
  wide = {name: n for name, n in record_widths(tree).items() if n > MAX_RECORD_FIELDS}
  assert not long, f"functions over {MAX_FUNCTION_LINES} lines in {module}: {long}"
  assert not wide, f"records over {MAX_RECORD_FIELDS} fields in {module}: {wide}"
