r"""The default job: UEA JapaneseVowels (bundled with ``aeon``, works offline) with a small model.

Same protocol as ``uea.py`` here (BatchNorm, post-norm, learnable positions, flattened read-out,
RAdam lr 1e-3, batch 16, test accuracy after every epoch) but a model small enough to train to the
end in a few minutes on a 2-core CPU: 2 layers, d_model 64, 4 heads, feed-forward 128, 40 epochs.

Command and expected result (``make train`` runs this, naming the config by its short name
``--config=default``; installed: ``primal-dual train --config=default --workdir=...``)::

  python train.py --config=primal_dual/configs/default.py --workdir=workdirs/default

prints the final metrics; ``best/test_accuracy`` (best over epochs, the published protocol) and
``test/accuracy`` (last epoch). Measured from a fresh clone on the project's idle 2-core CPU VM
(seed 0, 40 epochs = 640 steps: 270 training series, batch 16): both 0.9919, 19 s for the training command (3 seeds of the same
setup: 98.9 ± 0.3% best-test, README).

With ``bf16`` (``--config=default:bf16``: bfloat16 compute, float32 parameters) the same command
gave 0.9919 too (seed 0, both measured while other jobs shared the CPU).

Arguments: the same as ``uea.py`` (``attention=``, ``protocol=``, ``seed=``, ``epochs=``,
``runlocal``, ``bf16``; ``epochs`` is 40 here, ``epochs=-1`` too), e.g.
``--config=primal_dual/configs/default.py:attention=bn_sh``.
"""

from primal_dual.configs import uea
from primal_dual.training import config_lib


# This config's own training length; `epochs=-1` means it too, not uea's protocol length (100).
EPOCHS = 40


def get_config(arg=None):
  arg = config_lib.parse_arg(arg, **config_lib.RUN_ARGUMENTS, protocol="best_test", epochs=EPOCHS)
  epochs = config_lib.count_or_default(arg.epochs, EPOCHS, "epochs")
  flags = "".join(f",{flag}" for flag in ("runlocal", "bf16") if arg[flag])
  return uea.get_config(
    f"dataset=JapaneseVowels,size=small,attention={arg.attention},protocol={arg.protocol},"
    f"seed={arg.seed},epochs={epochs}{flags}"
  )
