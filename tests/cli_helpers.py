"""Loading the command-line scripts (train.py, eval.py) inside a test process.

absl keeps flags in one global registry, and loading a script defines its flags there; loading it
twice fails. `loaded_script` defines the flags, yields the module, and removes exactly the flags
the script added, whatever they are.
"""

import contextlib
import importlib.util
import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def loaded_script(relative_path: str):
  from absl import flags

  before = set(flags.FLAGS)
  name = "script_" + os.path.splitext(os.path.basename(relative_path))[0]
  spec = importlib.util.spec_from_file_location(name, os.path.join(REPO_ROOT, relative_path))
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
    yield module
  finally:
    for flag_name in set(flags.FLAGS) - before:
      delattr(flags.FLAGS, flag_name)
