"""The tasks the trainer runs, one module each: ``primal_dual/tasks/<name>.py`` builds the data
splits, builds the model and scores its outputs (loss and metrics), and registers itself on import
as ``Task(name=<name>)`` (``primal_dual.training.task_registry``). Modules whose names start with
``_`` hold what the tasks share (``_common``: losses, example weights, model arguments,
registration).

The trainer finds a task by this convention: a new task is one new module here plus its config in
``primal_dual/configs/``. The paper grids that train these tasks at many settings live outside the
package, in the repository's ``reproduce/`` folder.
"""
