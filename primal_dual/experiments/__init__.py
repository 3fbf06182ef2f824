"""The tasks, one module each: ``primal_dual/experiments/<task>.py`` holds a task's data wiring,
model, loss and metrics (registered with the trainer on import as ``Task(name=<task>)``) and its
paper grid (``REPRODUCTION``, run by ``primal-dual reproduce <task>``). The trainer finds a task by
this convention (``primal_dual.training.tasks.get_task``): a new task is one new module here plus
its config.
"""

import pkgutil

# The modules here that are not tasks: what the task modules share.
SHARED_MODULES = ("common", "grid")


def task_names() -> list[str]:
  """The task modules of this package, sorted (found on disk; nothing is imported)."""
  return sorted(
    module.name
    for module in pkgutil.iter_modules(__path__)
    if not module.name.startswith("_") and module.name not in SHARED_MODULES
  )
