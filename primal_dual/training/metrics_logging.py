"""Metric writers: JSON lines, TensorBoard (tensorboardX, no TensorFlow) and a progress bar.

Layout inside the workdir::

  metrics.jsonl        one JSON object per logged step: {"step": 200, "train/loss": ..., ...}
  tensorboard/         event files, one scalar tag per metric name

Names are split-prefixed: `train/loss`, `train/learning_rate`, `validation/accuracy`,
`best/test_accuracy`. Only process 0 writes; on other processes every method is a no-op, so
callers need no `if jax.process_index() == 0`.

On resume the trainer drops `metrics.jsonl` records later than the restored checkpoint (they are
written again). TensorBoard event files cannot be edited: a resumed run starts a new event file
that begins with a purge marker (`purge_step`, the first step it writes again), from which
TensorBoard drops the earlier files' events at that step or later, so each step shows once.
"""

import json
import math
import os
from typing import Mapping, Sequence

import jax

from primal_dual import atomic
from primal_dual.training import errors

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _as_float(value) -> float:
  return float(jax.device_get(value))


def _as_number(value) -> int | float:
  """Python ints (e.g. steps) stay ints; everything else becomes a float."""
  return value if isinstance(value, int) and not isinstance(value, bool) else _as_float(value)


def read_metrics(workdir: str) -> list[dict]:
  """All records of `workdir/metrics.jsonl`, in file order ([] if absent)."""
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def truncate_metrics_after(workdir: str, step: int) -> None:
  """Drops records with `step` greater than `step` (those written after the resumed checkpoint).

  A run killed between a checkpoint and its next log leaves records the resumed run will write
  again; dropping them keeps exactly one record per step.
  """
  if jax.process_index() != 0:
    return
  records = read_metrics(workdir)
  kept = [r for r in records if r.get("step", 0) <= step]
  if len(kept) == len(records):
    return
  atomic.write_text(
    os.path.join(workdir, METRICS_FILE), "".join(json.dumps(r) + "\n" for r in kept)
  )


class MetricWriter:
  """Writes scalars to `metrics.jsonl` and TensorBoard (process 0 only).

  Args:
    workdir: the run directory (created if missing).
    tensorboard: also write TensorBoard event files.
    purge_step: for a resumed run, the first step it writes again (restored step + 1): TensorBoard
      hides the events of the earlier files at this step or later. None for a new run.
  """

  def __init__(self, workdir: str, *, tensorboard: bool = True, purge_step: int | None = None):
    self._active = jax.process_index() == 0
    self._jsonl = None
    self._tensorboard = None
    if not self._active:
      return
    os.makedirs(workdir, exist_ok=True)
    self._jsonl = open(os.path.join(workdir, METRICS_FILE), "a")
    if tensorboard:
      # Imported lazily: tensorboardX pulls in protobuf, which a Colab user may not want.
      import tensorboardX

      self._tensorboard = tensorboardX.SummaryWriter(
        logdir=os.path.join(workdir, TENSORBOARD_DIR), flush_secs=30, purge_step=purge_step
      )

  def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    """Writes one record `{'step': step, **scalars}`; values may be JAX or NumPy scalars.

    Non-finite values are kept in TensorBoard and written as null in JSON (valid JSON).
    """
    if not self._active or not scalars:
      return
    values = {name: _as_number(value) for name, value in scalars.items()}
    record = {"step": int(step)}
    record.update({k: (v if math.isfinite(v) else None) for k, v in values.items()})
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    if self._tensorboard is not None:
      for name, value in values.items():
        self._tensorboard.add_scalar(name, value, global_step=int(step))

  def flush(self) -> None:
    if self._jsonl is not None:
      self._jsonl.flush()
    if self._tensorboard is not None:
      self._tensorboard.flush()

  def close(self) -> None:
    """Closes both files, the second even if the first fails (a full disk)."""
    files = [f for f in (self._jsonl, self._tensorboard) if f is not None]
    self._jsonl = self._tensorboard = None
    errors.close_all([f.close for f in files])

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()


class ProgressBar:
  """A tqdm bar over training steps (steps/s and ETA come from tqdm) on process 0.

  Args:
    total_steps: the final step.
    initial_step: the step a resumed run starts from.
    enabled: False gives a silent no-op bar (e.g. `config.progress_bar = False`).
  """

  def __init__(self, total_steps: int, initial_step: int = 0, *, enabled: bool = True):
    self._bar = None
    if enabled and jax.process_index() == 0:
      import tqdm
      import sys

      # In a log file (batch jobs) a redraw is a new line: redraw rarely.
      interactive = sys.stderr.isatty()
      self._bar = tqdm.tqdm(
        total=total_steps,
        initial=initial_step,
        unit="step",
        dynamic_ncols=True,
        smoothing=0.1,
        mininterval=0.5 if interactive else 60.0,
      )

  def update(self, steps: int = 1, **postfix: float) -> None:
    """Advances the bar; `postfix` values (e.g. loss) are shown after the rate."""
    if self._bar is None:
      return
    if postfix:
      self._bar.set_postfix({k: f"{_as_float(v):.4g}" for k, v in postfix.items()}, refresh=False)
    self._bar.update(steps)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None


def format_table(
  rows: Mapping[str, Mapping[str, float]],
  *,
  row_title: str = "split",
  columns: Sequence[str] | None = None,
) -> str:
  """Renders `{row: {column: value}}` as an aligned text table (`columns`, by default every
  column sorted by name).

  Example:
    >>> print(format_table({'test': {'accuracy': 0.75, 'loss': 0.9}}))
    split  accuracy  loss
    test   0.7500    0.9000
  """
  if columns is None:
    columns = sorted({c for values in rows.values() for c in values})

  def cell(value):
    return f"{value:.4f}" if isinstance(value, float) else str(value)

  table = [[row_title, *columns]] + [
    [name, *(cell(values[c]) if c in values else "-" for c in columns)]
    for name, values in rows.items()
  ]
  widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
  return "\n".join(
    "  ".join(text.ljust(w) for text, w in zip(line, widths)).rstrip() for line in table
  )
