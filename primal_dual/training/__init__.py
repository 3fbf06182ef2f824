"""Training library: configs, optimizer, sharding, checkpoints, logging, tasks and the trainer.

Import submodules directly (`from primal_dual.training import trainer`); this package imports
nothing heavy on its own so that `errors` and `config_lib` load fast in config files.
"""
