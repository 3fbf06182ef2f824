"""When periodic actions (log, eval, checkpoint, ...) happen: one rule for all of them.

Steps count completed training steps, 1 … total_steps. An action with period `every > 0` is due
after every step that is a multiple of `every`; every action is due after the final step, so a run
always ends with a log line, an evaluation and a checkpoint. `every ≤ 0` (or None) means "only at
the final step". The rule depends only on the step number, so a resumed run does exactly what an
uninterrupted one would.
"""

import dataclasses
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class PeriodicActions:
  """Decides which actions are due after a training step.

  Example:
    >>> actions = PeriodicActions(10, every={'log': 3, 'checkpoint': 0})
    >>> actions.due(3), actions.due(4), actions.due(10)
    (frozenset({'log'}), frozenset(), frozenset({'log', 'checkpoint'}))

  Attributes:
    total_steps: the final step (≥ 1).
    every: action name → period in steps (≤ 0 or None: final step only).
  """

  total_steps: int
  every: Mapping[str, int | None]

  def __post_init__(self):
    if self.total_steps < 1:
      raise ValueError(f"total_steps must be ≥ 1, got {self.total_steps}")
    object.__setattr__(self, "every", dict(self.every))

  def is_due(self, name: str, step: int) -> bool:
    """Whether action `name` is due after completed step `step`."""
    period = self.every[name]
    if step == self.total_steps:
      return True
    return bool(period) and period > 0 and 0 < step < self.total_steps and step % period == 0

  def due(self, step: int) -> frozenset[str]:
    """The set of actions due after completed step `step`."""
    return frozenset(name for name in self.every if self.is_due(name, step))

  def steps(self, name: str, start: int = 0) -> list[int]:
    """All steps in (start, total_steps] at which `name` is due, in order."""
    return [s for s in range(start + 1, self.total_steps + 1) if self.is_due(name, s)]
