"""The `primal-dual` console command (`python -m primal_dual`): its subcommands are train.py,
eval.py and the reproduce grids, run from any folder; user errors are one line with exit status 2."""

import importlib
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tomllib

import pytest

from primal_dual import commands
import primal_dual.commands.reproduce  # noqa: F401  (tests below patch its attributes)
import primal_dual.tasks
import reproduce
from primal_dual.training import task_registry

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args: list[str], cwd) -> subprocess.CompletedProcess:
  """`python -m primal_dual ARGS` in `cwd` (not the clone: packaged configs must be found)."""
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=REPO_ROOT,
    XLA_FLAGS="--xla_force_host_platform_device_count=1",
  )
  return subprocess.run(
    [sys.executable, "-m", "primal_dual", *args],
    capture_output=True,
    text=True,
    env=env,
    cwd=cwd,
    timeout=120,
    check=False,
  )


def _one_line_error(result: subprocess.CompletedProcess, pattern: str) -> None:
  assert result.returncode == 2, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
  assert re.search(pattern, lines[0]), lines[0]


def test_the_console_script_is_the_commands_main():
  with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
    scripts = tomllib.load(f)["project"]["scripts"]
  assert scripts == {"primal-dual": "primal_dual.commands:main"}


def test_help_lists_the_commands(tmp_path):
  result = _run(["--help"], tmp_path)
  assert result.returncode == 0
  for name in commands.COMMANDS:
    assert f"primal-dual {name}" in result.stdout


@pytest.mark.parametrize(
  "args, pattern",
  [
    (["trian"], r"unknown command 'trian'; choose one of train, eval, reproduce"),
    (
      ["reproduce", "uae"],
      r"unknown reproduction 'uae'; choose one of images, listops, logic, sraven, uea",
    ),
    (["train", "--config=uae", "--workdir=w"], r"unknown config 'uae'; packaged configs: default"),
    (
      ["train", "--config=default:runlocal", "--config.optimzer.lr=1", "--workdir=w"],
      r"did you mean --config\.optimizer\.lr\?",
    ),
    (["eval", "--workdir=no_such_workdir"], r"config\.json not found"),
  ],
)
def test_user_errors_are_one_line(args, pattern, tmp_path):
  _one_line_error(_run(args, tmp_path), pattern)


def test_no_command_prints_the_usage_and_fails(tmp_path):
  result = _run([], tmp_path)
  assert result.returncode == 2 and "primal-dual train" in result.stderr


def test_train_and_eval_help_list_their_flags(tmp_path):
  # absl's own --help exits with status 1; asking for help is no failure: 0.
  train = _run(["train", "--help"], tmp_path)
  assert train.returncode == 0, train.stderr
  assert "primal-dual train" in train.stdout
  assert "--config" in train.stdout and "--workdir" in train.stdout
  evaluate = _run(["eval", "--help"], tmp_path)
  assert evaluate.returncode == 0, evaluate.stderr
  assert "--checkpoint" in evaluate.stdout and "--analyses" in evaluate.stdout


def test_reproduce_help_lists_the_tasks_and_each_grid_its_flags(tmp_path):
  result = _run(["reproduce", "--help"], tmp_path)
  assert result.returncode == 0
  assert all(study in result.stdout for study in reproduce.study_names())
  grid_help = _run(["reproduce", "uea", "--help"], tmp_path)
  assert grid_help.returncode == 0
  assert grid_help.stdout.startswith("usage: primal-dual reproduce uea")
  assert "--jobs" in grid_help.stdout


def test_the_script_is_a_thin_wrapper_of_the_command(tmp_path):
  path = os.path.join(REPO_ROOT, "scripts", "reproduce.py")
  spec = importlib.util.spec_from_file_location("reproduce_script", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert module.reproduce_command is commands.reproduce
  # Run as a script from another folder, it finds the studies, not itself (its folder comes
  # first on Python's path, where a file named reproduce.py would shadow the package).
  result = subprocess.run(
    [sys.executable, path, "--help"],
    capture_output=True,
    text=True,
    cwd=tmp_path,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    check=False,
  )
  assert result.returncode == 0, result.stderr
  assert all(study in result.stdout for study in reproduce.study_names())


def test_reproduce_outside_a_clone_says_where_the_grids_live(monkeypatch, tmp_path, capsys):
  monkeypatch.setattr(commands.reproduce, "_clone_roots", lambda: [str(tmp_path)])
  assert commands.reproduce.main(["uea", "--dry_run"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "reproduce/ folder" in err[0] and "clone" in err[0]


@pytest.mark.parametrize("study", reproduce.study_names())
def test_every_study_module_declares_the_grid_of_a_task(study):
  module = importlib.import_module(f"reproduce.{study}")
  assert module.REPRODUCTION.task == study == task_registry.get_task(study).name


def test_studies_and_tasks_pair_up():
  """Every paper task has its study; the synthetic task (tests, smoke runs) has none."""
  assert set(task_registry.task_names()) - set(reproduce.study_names()) == {"synthetic"}


def test_every_grid_takes_the_shared_flags(tmp_path):
  """The same flag names for every task: a dry run of each quick grid lists its runs."""
  for task in reproduce.study_names():
    result = _run(
      ["reproduce", task, "--quick", "--dry_run", "--root=r", "--results=x.json"], tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{task} grid: ") and "to train" in result.stdout


TOY_TASK_MODULE = '''
"""A new task: the synthetic task's data, model and loss under the name 'toy'."""
from primal_dual.tasks import synthetic
from primal_dual.training import task_registry as tasks

TASK = tasks.register_task(tasks.Task("toy", synthetic.build_data,
    synthetic.build_model, synthetic._common.classification_loss_and_metrics))
'''

TOY_CONFIG = """
from primal_dual.training import config_lib

def get_config(arg=None):
  config = config_lib.training_defaults()
  config.task = "toy"
  config.num_train_steps = 2
  config.batch_size = 8
  config.progress_bar = False
  return config_lib.lock(config)
"""


def test_a_new_task_is_one_module_plus_its_config(monkeypatch, tmp_path):
  from primal_dual import configs
  from primal_dual.training import trainer

  # The module goes into a folder added to primal_dual.tasks' path, as if written there; nothing
  # under reproduce/ is touched.
  (tmp_path / "toy.py").write_text(TOY_TASK_MODULE)
  (tmp_path / "toy_config.py").write_text(TOY_CONFIG)
  package = primal_dual.tasks
  monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path)])
  monkeypatch.setattr(task_registry, "TASKS", dict(task_registry.TASKS))
  monkeypatch.delitem(sys.modules, "primal_dual.tasks.toy", raising=False)
  assert "toy" in task_registry.task_names() and "toy" not in reproduce.study_names()
  config = configs.load(str(tmp_path / "toy_config.py"), None)
  metrics = trainer.train_and_evaluate(config, str(tmp_path / "run"))
  assert metrics["step"] == 2 and task_registry.get_task("toy").name == "toy"


def test_output_cut_short_by_a_pipe_ends_quietly(tmp_path):
  """`primal-dual reproduce uea --dry_run | head -1`: the reader leaves; no BrokenPipeError."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT)
  command = f"{sys.executable} -m primal_dual reproduce uea --dry_run --root={tmp_path} | head -1"
  result = subprocess.run(
    ["bash", "-o", "pipefail", "-c", command],
    capture_output=True,
    text=True,
    env=env,
    cwd=REPO_ROOT,
    timeout=120,
  )
  assert result.stderr == "", result.stderr
  assert result.stdout.startswith("uea grid:")


@pytest.mark.parametrize(
  "args",
  [
    ["-m", "primal_dual", "list", "variants"],
    ["-m", "primal_dual", "--help"],
    ["-m", "primal_dual", "train", "--help"],
    ["train.py", "--help"],
    ["eval.py", "--help"],
    ["scripts/reproduce.py", "uea", "--dry_run", "--root={tmp}"],
  ],
  ids=" ".join,
)
def test_output_to_a_reader_that_left_ends_quietly_with_status_141(args, tmp_path):
  """The reader of the pipe is gone before the first line (`| head -0`, a pager quit early): no
  traceback, no `error:` line; status 141 (128 + SIGPIPE), as a shell reports a Unix tool's."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT)
  read_end, write_end = os.pipe()
  os.close(read_end)  # closed before the command starts: its first write finds no reader
  try:
    result = subprocess.run(
      [sys.executable, *(arg.format(tmp=tmp_path) for arg in args)],
      stdout=write_end,
      stderr=subprocess.PIPE,
      text=True,
      env=env,
      cwd=REPO_ROOT,
      timeout=120,
    )
  finally:
    os.close(write_end)
  assert (result.returncode, result.stderr) == (commands.EXIT_BROKEN_PIPE, "")
  assert commands.EXIT_BROKEN_PIPE == 128 + signal.SIGPIPE


def test_list_names_every_variant_config_argument_and_study(tmp_path):
  from primal_dual import configs, registry

  result = _run(["list"], tmp_path)
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  for name in registry.ATTENTION_REGISTRY:
    assert any(line.split()[:1] == [name] for line in lines), name
  for name in configs.packaged_names():
    assert any(line.strip().startswith(f"{name}: ") for line in lines), name
  assert "  uea: " in result.stdout and "dataset=JapaneseVowels" in result.stdout
  assert all(study in result.stdout for study in reproduce.study_names())
  only = _run(["list", "configs"], tmp_path)
  assert only.returncode == 0 and "attention variants" not in only.stdout
  # Each text argument with its allowed values, as the config's own refusal lists them.
  assert "  sraven: attention=softmax (a variant: list variants) " in only.stdout
  assert " preset=cpu (cpu|paper) " in only.stdout and " protocol=best_test (best_test|clean) " in (
    only.stdout
  )
  assert "data_dir='' (" not in only.stdout  # a folder has no list of values
  wrong = _run(["list", "knobs"], tmp_path)
  assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1 and "configs" in wrong.stderr


# The base install (jax, flax, numpy and what they bring: absl, optax, orbax): the [train] extra's
# other modules and the gpu-dev extra's are missing (None in sys.modules: importing one raises).
NOT_IN_THE_BASE_INSTALL = (
  "ml_collections",
  "grain",
  "tensorboardX",
  "tensorflow_datasets",
  "sklearn",
  "aeon",
  "matplotlib",
  "tqdm",
  "filelock",
  "triton",
  "torch",
  "jax_triton",
)
IN_THE_BASE_INSTALL = f"""
import sys
sys.modules.update(dict.fromkeys({NOT_IN_THE_BASE_INSTALL!r}))
from primal_dual.commands import main
sys.exit(main(sys.argv[1:]))
"""


def test_list_names_the_variants_in_the_base_install(tmp_path):
  """`primal-dual list` without the [train] and gpu-dev extras: every variant and study; the
  configs (ml_collections) say how to get them."""
  from primal_dual import registry

  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT)
  result = subprocess.run(
    [sys.executable, "-c", IN_THE_BASE_INSTALL, "list"],
    capture_output=True,
    text=True,
    env=env,
    cwd=tmp_path,
    timeout=120,
  )
  assert result.returncode == 0 and result.stderr == "", result.stderr
  lines = result.stdout.splitlines()
  for name in registry.ATTENTION_REGISTRY:
    assert any(line.split()[:1] == [name] for line in lines), name
  assert "  (the configs need the train extra: pip install 'primal_dual[train]')" in lines
  assert all(study in result.stdout for study in reproduce.study_names())


def test_the_summary_says_which_numbers_to_report():
  from primal_dual.commands import train

  final = {
    "test/accuracy": 0.9,
    "best/test_accuracy": 0.95,
    "selected/test_accuracy": 0.91,
    "selected/step": 40,
    "selected/rule": "max validation accuracy",
  }
  (line,) = train.which_to_report(final)
  # One short line naming the number, its value, its checkpoint and the rule that chose it.
  assert line == (
    "report: selected/test_accuracy = 0.91 (the step 40 checkpoint, chosen by max validation "
    "accuracy)"
  )
  assert train.which_to_report({"test/accuracy": 0.9, "best/test_accuracy": 0.95}) == []
  # Selected on the test split itself (UEA's best-test protocol): said to be optimistic.
  on_test = dict(final, **{"selected/rule": "max test accuracy; ties: lower test loss"})
  (line,) = train.which_to_report(on_test)
  assert line.endswith("chosen by max test accuracy; optimistic: test also chose it)")
  assert all(len(line) <= 120 for line in train.which_to_report(final))


def _sweep_final(settings: list[str], seeds: int, splits: dict[str, float]) -> dict:
  """A sweep's final metrics: per replica `<setting>,seed=<s>/...`, its selected number on each
  split `splits[split] + index of the setting / 100 + seed / 100`, chosen by max validation
  accuracy."""
  final = {}
  for index, setting in enumerate(settings):
    for seed in range(seeds):
      replica = f"{setting},seed={seed}" if setting else f"seed={seed}"
      final.update({f"{replica}/step": 100, f"{replica}/test/accuracy": 0.8})
      for split, base in splits.items():
        final[f"{replica}/selected/{split}_accuracy"] = base + index / 100 + seed / 100
      final[f"{replica}/selected/step"] = 40
      final[f"{replica}/selected/rule"] = "max validation accuracy; ties: lower validation loss"
  return final


def _mean_se(values: list[float]) -> str:
  return f"{statistics.mean(values):.4f} ± {statistics.stdev(values) / len(values) ** 0.5:.4f}"


def test_a_sweep_ends_with_a_table_of_its_settings_and_a_summary_file(tmp_path, capsys):
  """Replicas grouped by setting (the swept values but the seed), each number mean ± s.e. over
  its seeds; the report line names the number of the setting the validation split chose."""
  from primal_dual.commands import train
  from primal_dual.training import sweep

  final = _sweep_final(["lr=0.001", "lr=0.0003"], 6, {"validation": 0.7, "test": 0.9})
  train.print_final(final, str(tmp_path))
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == "replicas by setting: mean ± s.e. over seeds of selected/<split>_accuracy"
  assert lines[1].split() == ["setting", "seeds", "validation", "test"]
  # lr=0.0003 (the second setting, +0.01) comes first by name.
  tests = {s: [0.9 + s / 100 + i / 100 for i in range(6)] for s in (0, 1)}
  assert lines[2].split("  ")[0] == "lr=0.0003" and lines[2].endswith(_mean_se(tests[1]))
  assert lines[3].split()[:2] == ["lr=0.001", "6"] and lines[3].endswith(_mean_se(tests[0]))
  assert len(lines) == 2 + 2 + 2  # title, header, 2 settings, the summary file, the report line
  assert lines[4] == f"every replica's final metrics: {tmp_path / sweep.SUMMARY_FILE}"
  summary = json.loads((tmp_path / sweep.SUMMARY_FILE).read_text())
  assert len(summary) == 12 and summary["lr=0.001,seed=5"][
    "selected/test_accuracy"
  ] == pytest.approx(0.95)
  assert lines[5] == (
    f"report: selected/test_accuracy = {_mean_se(tests[1])} at lr=0.0003 (6 seeds; setting and "
    "checkpoints chosen by max validation accuracy)"
  )
  assert all(len(line) <= 100 for line in lines[:4])


def test_a_sweep_summary_fits_100_columns():
  """Five swept fields and three splits: the split neither choosing nor reported is left out."""
  from primal_dual.commands import train

  long = "lr=0.0003,wd=0.1,warmup=100,dropout=0.1,attn_dropout=0.1"
  splits = {"ood": 0.5, "validation": 0.7, "test": 0.9}
  wide = train.sweep_summary(_sweep_final([long, long.replace("wd=0.1", "wd=0.3")], 3, splits))
  assert wide[1].split() == ["setting", "seeds", "validation", "test"]
  assert max(map(len, wide)) <= 100
  narrow = train.sweep_summary(_sweep_final(["lr=0.001"], 3, splits))
  assert narrow[1].split() == ["setting", "seeds", "validation", "test", "ood"]
  # A seed-only sweep: one setting, the config's own; no test split: the report says optimistic.
  (line,) = train.which_to_report(_sweep_final([""], 2, {"validation": 0.7}))
  assert line == (
    "report: selected/validation_accuracy = 0.7050 ± 0.0050 (2 seeds; checkpoints chosen by max "
    "validation accuracy; optimistic: validation also chose it)"
  )
  assert train.sweep_summary(_sweep_final([""], 2, {"validation": 0.7}))[2].split()[:2] == [
    "-",
    "2",
  ]
  # No replica chose a checkpoint (no evaluation): the settings and their seeds, no report.
  unchosen = {"lr=0.1,seed=0/step": 4, "lr=0.1,seed=1/step": 4}
  assert train.sweep_summary(unchosen) == ["setting  seeds", "lr=0.1   2"]
  assert train.which_to_report(unchosen) == []
