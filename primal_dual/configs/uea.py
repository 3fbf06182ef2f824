r"""UEA multivariate time-series classification with the reference model of the protocol (docs/maths.md §4).

Reference model: 2 layers, d_model 512, 8 heads, feed-forward 2048, dropout 0.1, learnable
positional embedding, BatchNorm, post-norm, flattened read-out (the TST lineage of the protocol),
RAdam lr 1e-3, batch 16, 100 epochs (PEMS-SF 400), evaluation after every epoch.

Arguments (``--config=primal_dual/configs/uea.py:key=value,...``):
  dataset: archive name (``DATASETS``: the ten of the protocol plus BasicMotions). JapaneseVowels
    and BasicMotions ship with ``aeon``; the others are read from
    ``<manual_dir>/<Name>/<Name>_{TRAIN,TEST}.ts``.
  attention: any name of ``primal_dual.layers.ATTENTION_REGISTRY`` (softmax, linear,
    random_feature, bn, linear_bn, sh, bn_sh, hyla, hyla_*). SH variants get ``SH_RATIOS``.
  protocol: 'best_test' (report ``best/test_accuracy``, the best test accuracy over epochs: what
    published tables use, optimistic) or 'clean' (a stratified 20% validation split carved from
    TRAIN picks the checkpoint; report ``selected/test_accuracy``).
  size: 'reference' (the protocol's model) or 'small' (the ``default.py`` model: d_model 64,
    4 heads, feed-forward 128, for CPU budgets); ``MODEL_SIZES``.
  seed: model/data-order seed. epochs: -1 = the protocol's (100, PEMS-SF 400).
  manual_dir, data_dir: data folders. runlocal: a tiny model (1 layer, d 16, 2 heads) and 2 epochs
    (whatever ``epochs`` says), batch 8, for smoke tests.
  bf16: bfloat16 compute, float32 parameters (``--config.model.dtype=bfloat16``); float32
    without it, as the protocol's results.

SH head ratios (``DATASETS``). Attention-SH pools keys in windows of r_h; a pooled key then stands
for r_h time steps, so a ratio is only sensible when a window is short next to the series. With 8
heads we keep half the heads at full resolution and choose the rest by the longest series (the
padded length every example is attended at):
  * short series (max length < 64: JapaneseVowels 29, FaceDetection 62): (1,1,1,1,2,2,2,2),
    cost 0.75 — a ratio of 4 would leave JapaneseVowels' shortest series (7 steps) two keys;
  * medium (64–499: SpokenArabicDigits 93, BasicMotions 100, PEMS-SF 144, Handwriting 152,
    UWaveGestureLibrary 315, Heartbeat 405): (1,1,1,1,2,2,4,4), cost 0.69 — the coarsest heads
    still see ≥ 23 pooled keys;
  * long (≥ 500: SelfRegulationSCP1 896, SelfRegulationSCP2 1152, EthanolConcentration 1751):
    (1,1,2,2,4,4,8,8), cost 0.47 — even r = 8 leaves ≥ 112 pooled keys, and the quadratic cost
    of these lengths is where SH pays off.
Other head counts (``size=small``: 4 heads; ``runlocal``: 2) resample the pattern with the same
proportions (``sh_ratios_for``): short → (1,1,2,2) / (1,2), medium → (1,1,2,4) / (1,2).

Command (one run) and what to expect::

  python train.py --config=primal_dual/configs/uea.py:dataset=JapaneseVowels,attention=softmax \
      --workdir=workdirs/uea_jv_softmax

prints the final metrics, among them ``best/test_accuracy`` (best-test protocol). The published
reference for this data set and model is 98.7% (docs/maths.md §5, best test accuracy, labelled "reference"
in results/uea.md); this project's own measurements, over 3 seeds and both protocols, are in
results/uea.md, produced by ``scripts/reproduce.py uea`` (see its ``--help``). A reference-model
run of JapaneseVowels takes on the order of 10–20 minutes on a 2-core CPU; ``size=small`` a few.
"""

from primal_dual import registry
from primal_dual.configs import _base
from primal_dual.training import config_lib
from primal_dual.training import errors

SHORT, MEDIUM, LONG = (1, 1, 1, 1, 2, 2, 2, 2), (1, 1, 1, 1, 2, 2, 4, 4), (1, 1, 2, 2, 4, 4, 8, 8)

# Data set → (SH ratios for 8 heads, epochs of the protocol).
DATASETS = {
  "EthanolConcentration": (LONG, 100),
  "FaceDetection": (SHORT, 100),
  "Handwriting": (MEDIUM, 100),
  "Heartbeat": (MEDIUM, 100),
  "JapaneseVowels": (SHORT, 100),
  "PEMS-SF": (MEDIUM, 400),
  "SelfRegulationSCP1": (LONG, 100),
  "SelfRegulationSCP2": (LONG, 100),
  "SpokenArabicDigits": (MEDIUM, 100),
  "UWaveGestureLibrary": (MEDIUM, 100),
  "BasicMotions": (MEDIUM, 100),
}
# The ten data sets of the standard protocol (docs/maths.md §4); BasicMotions is an offline extra.
PROTOCOL_DATASETS = tuple(name for name in DATASETS if name != "BasicMotions")
# Shipped inside the aeon package: available without a download.
BUNDLED_DATASETS = ("JapaneseVowels", "BasicMotions")

PROTOCOLS = ("best_test", "clean")

MODEL_SIZES = {
  "reference": dict(num_layers=2, model_dim=512, num_heads=8, mlp_dim=2048),
  "small": dict(num_layers=2, model_dim=64, num_heads=4, mlp_dim=128),
}
# A tiny model and 2 epochs (whatever ``epochs`` says), batch 8: a smoke test.
RUNLOCAL = dict(model=_base.RUNLOCAL_MODEL, num_epochs=2, batch_size=8, checkpoint_every_epochs=1)


def sh_ratios_for(ratios: tuple[int, ...], num_heads: int) -> tuple[int, ...]:
  """Resamples an 8-head ratio pattern to ``num_heads`` heads (same proportions)."""
  return tuple(ratios[(i * len(ratios)) // num_heads] for i in range(num_heads))


def _check_choice(name: str, value: str, choices) -> None:
  if value not in choices:
    raise errors.ConfigError(
      f"primal_dual/configs/uea.py: unknown {name} {value!r}; choose one of "
      f"{', '.join(sorted(choices))}"
    )


def get_config(arg=None):
  arg = config_lib.parse_arg(
    arg,
    **config_lib.RUN_ARGUMENTS,
    dataset="JapaneseVowels",
    protocol="best_test",
    size="reference",
    epochs=-1,
    manual_dir="",
    data_dir="",
  )
  _check_choice("dataset", arg.dataset, DATASETS)
  _check_choice("attention", arg.attention, registry.ATTENTION_REGISTRY)
  _check_choice("protocol", arg.protocol, PROTOCOLS)
  _check_choice("size", arg.size, MODEL_SIZES)
  ratios, epochs = DATASETS[arg.dataset]

  config = _base.build(
    "uea",
    arg,
    dict(
      data=dict(
        dataset=arg.dataset,
        protocol=arg.protocol,
        data_dir=arg.data_dir,
        manual_dir=arg.manual_dir,
        validation_fraction=0.2,
        split_seed=0,
      ),
      model=dict(
        **MODEL_SIZES[arg.size],
        positional="learned",
        pre_norm=False,
        norm="batch",
        pooling="flatten",
        dropout_rate=0.1,
        attention_dropout_rate=0.0,
      ),
      batch_size=16,
      num_epochs=config_lib.count_or_default(arg.epochs, epochs, "epochs"),
      eval_every_epochs=1,
      checkpoint_every_epochs=10,
      log_every_steps=50,
      optimizer=dict(name="radam", lr=1e-3),
      selection=dict(split="validation" if arg.protocol == "clean" else "test", metric="accuracy"),
    ),
    RUNLOCAL if arg.runlocal else {},
  )
  return _base.finish(config, ratios=sh_ratios_for(ratios, config.model.num_heads))
