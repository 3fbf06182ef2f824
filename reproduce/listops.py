"""The LRA ListOps study: accuracy and attention cost of the five attention forms in the
PyTorch-lineage and JAX-LRA settings: its grid, record schema, report and reference numbers
(``primal-dual reproduce listops``). ``model_summary`` gives a config's parameter count and its
analytic attention FLOPs per example (``primal_dual.analysis.flops``: the products inside every
layer's attention kernel at the padded length the model computes on, CLS included; multiply-add =
2 FLOPs; projections, exponentials, BN statistics and SH pooling left out). The task:
``primal_dual/tasks/listops.py``.
"""

from __future__ import annotations

import argparse
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import ml_collections

from primal_dual.analysis import flops
from primal_dual.tasks import listops as listops_task
from reproduce import grid
from primal_dual.models import model_parameter_count


# ------------------------------------------------------------------------------------------------
# The reproduction grid (``primal-dual reproduce listops``).

GRID_COMMANDS = r"""
Runs variants × seeds with ``primal_dual/configs/listops.py`` (one workdir per run under
``--root``), then writes

* ``--results`` (default results/listops.json): one record per run (``RECORD_SCHEMA``): test
  accuracy after the last step (LRA's protocol), test accuracy at the best validation accuracy,
  parameter count, analytic attention FLOPs per example, wall time;
* the same path with ``.md``: mean ± std over seeds per variant, a column "reference (published,
  full scale)" with docs/maths.md §5's softmax numbers, and the full-scale commands.

Resuming: a finished run (``final_metrics.json`` in its workdir) is reused and an interrupted one
resumes from its last checkpoint, so re-running the same command only does what is missing.

Commands (from the repository root; ``primal-dual reproduce listops`` where the package is
installed)::

  # CPU grid: PyTorch-lineage model (2 layers, d 64, 2 heads), short preset (10k/500/500, up to
  # 500 tokens), 5 variants × 3 seeds, 5000 steps each (the lineage's schedule). Measured on this
  # 2-core CPU at batch 32: a training step costs 1.3 s of CPU time for softmax, sh and bn_sh and
  # 0.7 s for linear (primal), i.e. roughly 1–1.5 h per run and 15–20 h for the grid;
  # --steps=1000 cuts that five-fold (a truncated schedule, recorded in the table).
  .venv/bin/python scripts/reproduce.py listops

  # Full scale (accelerator): the JAX LRA model on the LRA-sized data (96k, 500–2000 tokens).
  .venv/bin/python scripts/reproduce.py listops --setting=jax_lra --scale=full \
      --root=workdirs/listops_lra --results=results/listops_lra.json

  # Smoke test: tiny preset and model, 4 steps, softmax and sh, one seed (2 runs).
  .venv/bin/python scripts/reproduce.py listops --quick --root=/tmp/listops_smoke \
      --results=/tmp/listops_smoke/listops.json
"""
CONFIG_FILE = "listops"  # a packaged config (primal_dual/configs/listops.py)
SETTINGS = ("pytorch", "jax_lra")
PRESETS = ("short", "full")

# docs/maths.md §5, published by others at full scale (LRA data, 5000 steps): (setting, variant) → accuracy.
REFERENCE = {("jax_lra", "softmax"): 0.3637, ("pytorch", "softmax"): 0.371}
REFERENCE_HEADER = "reference (published, full scale)"

FULL_SCALE_COMMANDS = """\
## Full-scale commands (GPU/TPU)

JAX LRA setting (4 layers, d 512, 8 heads, MLP 1024, CLS pooling, batch 32, 5000 steps) on the
LRA-sized data (`preset=full`: 96k/2k/2k expressions of 500–2000 tokens; generated and prepared
with TFDS on first use, about half a minute):

```
python train.py --config=primal_dual/configs/listops.py:setting=jax_lra,preset=full,attention=softmax \\
    --workdir=workdirs/listops_lra_softmax
python scripts/reproduce.py listops --setting=jax_lra --scale=full \\
    --root=workdirs/listops_lra --results=results/listops_lra.json
```

PyTorch-lineage setting at full scale:

```
python scripts/reproduce.py listops --setting=pytorch --scale=full \\
    --root=workdirs/listops_pytorch_full --results=results/listops_pytorch_full.json
```
"""

RECORD_SCHEMA: dict[str, tuple[type, ...]] = {
  **grid.RUN_RECORD_SCHEMA,
  "setting": (str,),
  "preset": (str,),
  **grid.VARIANT_RUN_SCHEMA,
  "test_accuracy": grid.NUMBER,
  "selected_test_accuracy": grid.NUMBER,
  "best_validation_accuracy": grid.NUMBER,
  "selected_step": (int,),
  **grid.SIZE_AND_COST_SCHEMA,
}


def validate_record(record: Mapping[str, Any]) -> None:
  """Raises ValueError naming every field of ``RECORD_SCHEMA`` missing or of the wrong type."""
  grid.check_schema(record, RECORD_SCHEMA, "ListOps")


def build_runs(args: argparse.Namespace) -> list[grid.GridRun]:
  """The grid in seed-major order, so a half-finished grid already covers every variant."""
  preset = "tiny" if args.quick else args.preset

  def run(attention: str, seed: int) -> grid.GridRun:
    config_arg = grid.config_argument(
      dict(setting=args.setting, preset=args.preset, attention=attention, seed=seed),
      dict(steps=args.steps, data_dir=args.data_dir),
      runlocal=args.quick,
    )
    steps = int(grid.load_config(CONFIG_FILE, config_arg).num_train_steps)
    labels = dict(setting=args.setting, preset=preset)
    return grid.variant_run(CONFIG_FILE, config_arg, labels, attention, seed, steps, args.quick)

  return grid.seed_major_runs(args, run)


def record_fn(
  run: grid.GridRun, metrics: Mapping[str, Any], workdir: str, args: argparse.Namespace
) -> dict[str, Any]:
  """A record's task fields: accuracies, size and attention cost of one run."""
  del workdir, args
  return {
    "test_accuracy": float(metrics["test/accuracy"]),
    "selected_test_accuracy": float(metrics["selected/test_accuracy"]),
    "best_validation_accuracy": float(metrics["best/validation_accuracy"]),
    "selected_step": int(metrics["selected/step"]),
    **grid.size_and_cost_fields(model_summary, run),
  }


# ------------------------------------------------------------------------------------------------
# Report.


def markdown_report(records: Sequence[Mapping[str, Any]], command: str) -> str:
  """results/listops.md: mean ± std over seeds per variant, reference column, full-scale runs."""
  setting = records[0]["setting"]

  def reference(key: tuple) -> str:
    value = REFERENCE.get((setting, key[0]))
    return "–" if value is None else f"{100 * value:.2f}"

  columns = {
    "test acc % (last step)": grid.field("test_accuracy"),
    "test acc % (validation-selected)": grid.field("selected_test_accuracy"),
    "wall time (min)": grid.field("wall_time_s"),
  }
  extra = {**grid.size_and_cost_columns(records, "example"), REFERENCE_HEADER: reference}
  presets, steps, seeds, lengths = grid.distinct_values(
    records, "preset", "steps", "seed", "sequence_length"
  )
  lines = [
    "# ListOps (Long Range Arena): accuracy and attention cost per variant\n",
    f"Measured by `{command}` on {grid.describe_hardware(records)}; setting `{setting}`, preset {', '.join(presets)}, "
    f"{', '.join(map(str, steps))} steps, seeds {', '.join(map(str, seeds))}. Cells are "
    "mean ± std over seeds (n runs). *Last step*: test accuracy after the final step (LRA's "
    "protocol). *Validation-selected*: test accuracy at the evaluation with the best validation "
    "accuracy. Attention FLOPs are analytic: the products inside every layer's attention kernel "
    f"for one example at the padded length ({', '.join(map(str, lengths))} tokens), "
    "multiply-add = 2, projections left out (primal_dual/analysis/flops.py); linear runs in its "
    "O(N) primal form. Wall time covers training and the periodic evaluations."
    + grid.shared_machine_note(command)
    + " Per-run records: listops.json.\n",
    f"The column *{REFERENCE_HEADER}* holds docs/maths.md §5's published softmax number for this "
    "setting, measured by others on the full LRA data (96k examples of 500–2000 tokens, 5000 "
    "steps) with their own code. "
    + (
      "It is not comparable to the runs above, which use a smaller preset (shorter "
      "sequences, less data).\n"
      if presets != ["full"] or steps != [5000]
      else "The runs above use the same data scale and schedule with this library's code.\n"
    ),
    grid.summary_table(records, ("attention",), columns, {"wall time (min)": 1 / 60}, extra),
    FULL_SCALE_COMMANDS,
  ]
  return "\n".join(lines)


# The grid's own flags: flag → add_argument options.
FLAGS: dict[str, dict[str, Any]] = {
  "--setting": dict(choices=SETTINGS, default="pytorch"),
  "--scale": dict(dest="preset", choices=PRESETS, default="short", help="the config's preset="),
  "--steps": dict(type=int, default=-1, help="-1: the setting's (5000)"),
  "--data_dir": dict(default="", help="TFDS data folder (default TFDS's)"),
}


REPRODUCTION = grid.module_reproduction(
  __name__,
  task="listops",
  summary="ListOps (LRA) accuracy and attention cost for softmax, linear, BN, SH and BN+SH.",
  quick="tiny preset and model, 4 steps, 2 runs by default",
  variants=grid.ATTENTION_FORMS,
)


def model_summary(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Size and attention cost of a ListOps config (no data is read).

  Returns:
    ``{'parameters': int, 'attention_flops': float (one example, forward, all layers),
    'attention_flops_relative': float (to softmax attention), 'sequence_length': int (padded,
    CLS included)}``.
  """
  metadata = listops_task.listops_metadata(config)
  model = listops_task.build_model(config, metadata)
  length = metadata["max_length"]
  tokens = jnp.zeros((1, length), jnp.int32)
  parameters = model_parameter_count(model, tokens, mask=jnp.ones((1, length), bool), train=False)
  prefix = 1 if config.model.pooling == "cls" else 0
  cost = flops.attention_flops(config.model, seq_len=length, num_prefix_tokens=prefix)
  return {
    "parameters": parameters,
    "attention_flops": cost["total"],
    "attention_flops_relative": cost["relative_to_softmax"],
    "sequence_length": length + prefix,
  }
