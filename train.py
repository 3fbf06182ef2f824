"""Train a model: `python train.py --config=<config>[:arg] --workdir=<dir>`, the same as
`primal-dual train`.

`<config>` is a packaged config's short name (`default`, `uea`, ...) or a config file's path, e.g.
`--config=primal_dual/configs/uea.py:dataset=Heartbeat`; `--config.<field>=<value>` overrides a
field. The command itself (flags, errors, resuming) is `primal_dual/commands/train.py`.
"""

from primal_dual.commands import train as _command
from primal_dual.commands import cli

_command.define_flags()
main = _command.main

if __name__ == "__main__":
  cli.run_command(main)
