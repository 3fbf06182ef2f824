"""The README's commands: its Python blocks run as written, the first training command is a quick
one, the long ones are labelled for a GPU, and the README and docs/training.md give the same
command for the same model."""

import os
import re

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Configs that train in about a minute on a 2-core CPU without `runlocal`.
QUICK_CONFIGS = ("default",)


def _read(relative: str) -> str:
  with open(os.path.join(REPO_ROOT, relative)) as f:
    return f.read()


def _commands(text: str) -> list[tuple[str, str]]:
  """(comment lines just above, command with its continuation lines) of every `train.py` call in
  the ```bash blocks of `text`."""
  found = []
  for block in re.findall(r"```bash\n(.*?)```", text, re.S):
    joined = block.replace("\\\n", " ")
    comments = []
    for line in joined.splitlines():
      if line.startswith("#"):
        comments.append(line)
        continue
      if "train.py" in line:
        found.append(("\n".join(comments), line))
      comments = []
  return found


def _config_arg(command: str) -> str:
  return re.search(r"--config=(\S+)", command).group(1)


def test_the_first_training_command_is_quick_on_a_cpu():
  _, first = _commands(_read("README.md"))[0]
  config = _config_arg(first)
  assert config in QUICK_CONFIGS or "runlocal" in config, first


def test_every_long_command_is_labelled_for_a_gpu():
  for comment, command in _commands(_read("README.md")):
    config = _config_arg(command)
    if config in QUICK_CONFIGS or "runlocal" in config:
      continue
    assert "GPU" in comment, command


def test_readme_and_training_doc_train_the_reference_model_alike():
  def jv_bn_sh(relative):
    return {
      re.search(r"--config\.optimizer\.lr=(\S+)", command).group(1)
      for _, command in _commands(_read(relative))
      if "JapaneseVowels,attention=bn_sh" in command and "runlocal" not in command
    }

  assert jv_bn_sh("README.md") == jv_bn_sh("docs/training.md") == {"3e-4"}


def test_every_doc_the_code_and_readme_cite_exists():
  cited = set()
  for folder, _, files in os.walk(os.path.join(REPO_ROOT, "primal_dual")):
    for name in files:
      if name.endswith(".py"):
        with open(os.path.join(folder, name)) as f:
          cited.update(re.findall(r"docs/[\w/]+\.md", f.read()))
  cited.update(re.findall(r"docs/[\w/]+\.md", _read("README.md")))
  missing = sorted(path for path in cited if not os.path.exists(os.path.join(REPO_ROOT, path)))
  assert not missing


def test_every_python_block_runs_as_written():
  blocks = re.findall(r"```python\n(.*?)```", _read("README.md"), re.S)
  assert blocks
  for block in blocks:
    exec(compile(block, "README.md", "exec"), {})


def test_every_quick_training_command_says_what_it_reaches():
  """The README's quick commands (the first bash block) state the accuracy each training
  command reaches, in the comment just above it."""
  quick_block = re.search(r"```bash\n(.*?)```", _read("README.md").split("Quick on a CPU")[1], re.S)
  commands = _commands("```bash\n" + quick_block.group(1) + "```")
  assert commands
  for comments, command in commands:
    assert re.search(r"\d%", comments), f"no accuracy stated above: {command}"
