r"""UEA multivariate time-series classification with the reference model of the protocol (SPEC §4).

Reference model: 2 layers, d_model 512, 8 heads, feed-forward 2048, dropout 0.1, learnable
positional embedding, BatchNorm, post-norm, flattened read-out (the TST lineage of the protocol),
RAdam lr 1e-3, batch 16, 100 epochs (PEMS-SF 400), evaluation after every epoch.

Arguments (``--config=configs/uea.py:key=value,...``):
  dataset: archive name; JapaneseVowels and BasicMotions ship with ``aeon``; the other data sets
    are read from ``<manual_dir>/<Name>/<Name>_{TRAIN,TEST}.ts``.
  attention: any name of ``primal_dual.layers.ATTENTION_REGISTRY``.
  protocol: 'best_test' (best test accuracy over epochs, what published tables use) or 'clean'
    (validation carved from TRAIN picks the checkpoint whose test accuracy is reported).
  seed: model/data-order seed. epochs: -1 = the protocol's (100, PEMS-SF 400).
  manual_dir, data_dir: data folders. runlocal: a tiny model and 2 epochs, for smoke tests.

SH head ratios (``SH_RATIOS``). Attention-SH pools keys in windows of r_h; a pooled key then stands
for r_h time steps, so a ratio is only sensible when a window is short next to the series. With 8
heads we keep half the heads at full resolution and choose the rest by series length:
  * short series (max length < 64: JapaneseVowels 29, FaceDetection 62): (1,1,1,1,2,2,2,2),
    cost 0.75 — a ratio of 4 would leave JapaneseVowels' shortest series (7 steps) two keys;
  * medium (64–499: BasicMotions 100, SpokenArabicDigits 93, PEMS-SF 144, Handwriting 152,
    UWaveGestureLibrary 315, Heartbeat 405): (1,1,1,1,2,2,4,4), cost 0.69;
  * long (≥ 500: SelfRegulationSCP1 896, SelfRegulationSCP2 1152, EthanolConcentration 1751):
    (1,1,2,2,4,4,8,8), cost 0.47.

Example::

  python train.py --config=configs/uea.py:dataset=JapaneseVowels,attention=bn_sh,protocol=clean \
      --workdir=workdirs/jv_bn_sh
"""

from primal_dual.training import config_lib

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
# The ten data sets of the standard protocol (SPEC §4); BasicMotions is an offline extra.
PROTOCOL_DATASETS = tuple(name for name in DATASETS if name != "BasicMotions")

SH_VARIANTS = ("sh", "bn_sh")


def sh_ratios_for(ratios: tuple[int, ...], num_heads: int) -> tuple[int, ...]:
  """Resamples an 8-head ratio pattern to ``num_heads`` heads (same proportions)."""
  return tuple(ratios[(i * len(ratios)) // num_heads] for i in range(num_heads))


def get_config(arg=None):
  arg = config_lib.parse_arg(arg, dataset="JapaneseVowels", attention="softmax",
                             protocol="best_test", seed=0, epochs=-1, manual_dir="",
                             data_dir="", runlocal=False)
  if arg.dataset not in DATASETS:
    raise ValueError(f"unknown UEA data set {arg.dataset!r}; configured: {sorted(DATASETS)}")
  ratios, epochs = DATASETS[arg.dataset]

  config = config_lib.training_defaults()
  config.task = "uea"
  config.seed = arg.seed
  config.data = dict(dataset=arg.dataset, protocol=arg.protocol, data_dir=arg.data_dir,
                     manual_dir=arg.manual_dir, validation_fraction=0.2, split_seed=0)
  config.model = dict(num_layers=2, model_dim=512, num_heads=8, mlp_dim=2048,
                      positional="learned", pre_norm=False, norm="batch", pooling="flatten",
                      dropout_rate=0.1, attention_dropout_rate=0.0, attention=arg.attention,
                      attention_options={})
  config.batch_size = 16
  config.num_epochs = epochs if arg.epochs < 0 else arg.epochs
  config.eval_every_epochs = 1
  config.checkpoint_every_epochs = 10
  config.log_every_steps = 50
  config.optimizer.name = "radam"
  config.optimizer.lr = 1e-3
  config.selection.split = "validation" if arg.protocol == "clean" else "test"
  config.selection.metric = "accuracy"

  if arg.runlocal:
    config.model.update(num_layers=1, model_dim=16, num_heads=2, mlp_dim=32)
    config.num_epochs = 2
    config.batch_size = 8
    config.checkpoint_every_epochs = 1
  if arg.attention in SH_VARIANTS:
    config.model.attention_options = dict(
        ratios=sh_ratios_for(ratios, config.model.num_heads))
  return config_lib.lock(config)
