"""Model selection: the best value of one metric per split, and the evaluation chosen on the
selection split (`EvalTracker`, checkpointed with the run)."""

import math
import operator
from typing import Callable, Collection, Mapping

import ml_collections

from primal_dual.training import errors
from primal_dual.training import task_registry

_MODES: dict[str, Callable[[float, float], bool]] = {"max": operator.gt, "min": operator.lt}


def _loss_rank(loss: float | None) -> float:
  """A loss for comparison: missing or non-finite losses rank as infinitely bad."""
  return loss if loss is not None and math.isfinite(loss) else math.inf


class EvalTracker:
  """Tracks the best value of one metric per split and the evaluation chosen on one split.

  `best/` keeps the earliest of tied values. The selected evaluation is the one with the best
  metric on the selection split; ties go to the lower loss on that split, then to the later step
  (`rule` states this). Non-finite metric values are ignored.

  Args:
    metric: metric name, e.g. 'accuracy'.
    mode: 'max' or 'min'.
    selection_split: the split whose metric chooses the 'selected' evaluation.
  """

  def __init__(self, metric: str, mode: str, selection_split: str):
    self.metric = metric
    self.mode = mode
    self._better = errors.lookup(_MODES, mode, "selection mode (config.selection.mode)")
    self.selection_split = selection_split
    self.best: dict[str, float] = {}
    self.best_step: dict[str, int] = {}
    self.selected: dict[str, float] = {}
    self.selected_step: int | None = None

  @property
  def rule(self) -> str:
    """The selection rule in words (written to final_metrics.json as `selected/rule`)."""
    split = self.selection_split
    return f"{self.mode} {split} {self.metric}; ties: lower {split} loss, then later step"

  def update(self, step: int, results: Mapping[str, Mapping[str, float]]) -> bool:
    """Records one evaluation (split → metric → value); True if it became the selected one."""
    for split, metrics in results.items():
      value = metrics.get(self.metric)
      if value is None or not math.isfinite(value):
        continue
      if split not in self.best or self._better(value, self.best[split]):
        self.best[split], self.best_step[split] = value, step
    selection = results.get(self.selection_split, {})
    value = selection.get(self.metric)
    if value is None or not math.isfinite(value):
      return False
    if not self._beats_selected(value, selection.get("loss")):
      return False
    self.selected = {
      f"{split}_{name}": v for split, metrics in results.items() for name, v in metrics.items()
    }
    self.selected_step = step
    return True

  def _beats_selected(self, value: float, loss: float | None) -> bool:
    """Whether a later evaluation with selection metric `value` and loss `loss` replaces the
    selected one: a better metric, or an equal metric with a loss that is not higher."""
    current = self.selected.get(f"{self.selection_split}_{self.metric}")
    if current is None or self._better(value, current):
      return True
    if value != current:
      return False
    current_loss = self.selected.get(f"{self.selection_split}_loss")
    return _loss_rank(loss) <= _loss_rank(current_loss)  # equal losses: the later step wins

  def summary(self) -> dict[str, float]:
    """`best/{split}_{metric}`, `best/{split}_step`, `selected/{split}_{name}`, `selected/step`."""
    out = {}
    for split, value in self.best.items():
      out[f"best/{split}_{self.metric}"] = value
      out[f"best/{split}_step"] = self.best_step[split]
    if self.selected_step is not None:
      out.update({f"selected/{key}": value for key, value in self.selected.items()})
      out["selected/step"] = self.selected_step
    return out

  def state_dict(self) -> dict:
    return dict(
      best=self.best,
      best_step=self.best_step,
      selected=self.selected,
      selected_step=self.selected_step,
    )

  def load_state_dict(self, state: Mapping) -> None:
    self.best = dict(state.get("best", {}))
    self.best_step = {k: int(v) for k, v in state.get("best_step", {}).items()}
    self.selected = dict(state.get("selected", {}))
    self.selected_step = state.get("selected_step")


# Metrics for which lower is better (by name ending): 'loss', 'nll_loss', 'error', 'perplexity'.
_LOWER_IS_BETTER = ("loss", "error", "perplexity")


def selection_metric_and_mode(
  config: ml_collections.ConfigDict,
  task: task_registry.Task,
  reported: Collection[str] | None = None,
) -> tuple[str, str]:
  """`config.selection`'s metric and mode, the task's defaults where unset, checked.

  An unset mode is the task's for the task's own metric, else 'min' for loss-like metrics
  (`_LOWER_IS_BETTER`) and 'max' for the others.

  Args:
    config: the resolved config.
    task: the config's task.
    reported: the metric names the task's evaluation reports; None skips that check.

  Raises:
    errors.ConfigError: a metric the task does not report (no `best/`, `selected/` would ever
      be written), or mode 'max' for a loss-like metric (it would select the worst checkpoint).
  """
  selection = config.selection
  metric = selection.metric or task.selection_metric
  if reported is not None and metric not in reported:
    raise errors.ConfigError(
      f"config.selection.metric={metric!r} is not a metric of task {task.name!r}; it reports "
      f"{', '.join(sorted(reported))}"
    )
  lower_is_better = metric.endswith(_LOWER_IS_BETTER)
  if selection.mode:
    if selection.mode == "max" and lower_is_better:
      raise errors.ConfigError(
        f"config.selection.mode='max' with metric {metric!r} selects the worst checkpoint; "
        "set config.selection.mode='min' (or leave it unset)"
      )
    return metric, selection.mode
  if metric == task.selection_metric:
    return metric, task.selection_mode
  return metric, "min" if lower_is_better else "max"


def make_tracker(
  config: ml_collections.ConfigDict,
  task: task_registry.Task,
  reported: Collection[str] | None = None,
) -> EvalTracker:
  """The tracker of `config.selection` (`selection_metric_and_mode`)."""
  metric, mode = selection_metric_and_mode(config, task, reported)
  return EvalTracker(metric=metric, mode=mode, selection_split=config.selection.split)
