"""Golden metrics of the trainer's training step: a silent numerical change anywhere between the data and
the update (kernels, model, loss, optimizer) moves these numbers.

The values were recorded on this project's CPU (jaxlib 0.10.2) and hold to 1e-5 relative there;
another backend or XLA version may round differently (update them with the printed values)."""

import contextlib

import jax
import numpy as np
import pytest

from primal_dual.configs import sraven as sraven_configs
from primal_dual.training import config_lib
from primal_dual.training import setup

# sRAVEN runlocal (the paper's model structure: unidirectional buckets, attention dropout 0.1),
# softmax and HYLA: two steps on the first 8 training problems (the first at warm-up's learning
# rate 0, the second moves the parameters); losses of both, the second's gradient norm and the
# sum of the parameters after it.
GOLDEN = {
  "softmax": {
    "loss_0": 2.357109546661377,
    "loss_1": 2.3630270957946777,
    "grad_norm": 199.45819091796875,
    "param_sum": 50.09725376274764,
  },
  "hyla": {
    "loss_0": 2.5326290130615234,
    "loss_1": 2.696837902069092,
    "grad_norm": 2612.931640625,
    "param_sum": 50.01769677232369,
  },
}


def _two_steps(attention: str, jit: bool) -> dict[str, float]:
  config = config_lib.with_fields(
    sraven_configs.get_config(f"attention={attention},runlocal"), {"mesh.data": 1}
  )
  program = setup.build_program(setup.resolve_config(config))
  state = program.init()
  batch = setup.stack_records([program.splits["train"][i] for i in range(8)])
  losses = []
  # The trainer's own one-step program (a single run: one replica, no replica axis); with jit
  # disabled the same code runs op by op.
  with contextlib.nullcontext() if jit else jax.disable_jit():
    for _ in range(2):
      state, loss, metrics = program.run_steps(state, 1, iter([batch]))
      losses.append(float(loss[0]))
  param_sum = sum(
    float(np.sum(np.asarray(x, np.float64))) for x in jax.tree.leaves(jax.device_get(state.params))
  )
  return {
    "loss_0": losses[0],
    "loss_1": losses[1],
    "grad_norm": float(metrics["grad_norm"][0]),
    "param_sum": param_sum,
  }


@pytest.mark.parametrize("attention", sorted(GOLDEN))
@pytest.mark.parametrize("jit", [True, False])
def test_train_steps_match_the_golden_metrics(attention, jit):
  got = _two_steps(attention, jit)
  for name, value in GOLDEN[attention].items():
    assert got[name] == pytest.approx(value, rel=1e-5), (name, got)
