"""DeiT/ViT-style image classifier: patch embedding, CLS token, learnable positions, pre-LN blocks.

Attention-SH variants pool keys 2-D over the patch grid and keep the CLS token unpooled: the
model passes ``grid_shape`` and ``num_prefix_tokens=1`` to every kernel that declares them.
"""

from __future__ import annotations


import flax.linen as nn
import jax.numpy as jnp

from primal_dual.models.blocks import AttentionFields, Dropout, EncoderBlock

# Sizes of the published DeiT models (Touvron et al. 2021) and a micro size for CPU demos.
VIT_PRESETS: dict[str, dict[str, int]] = {
  "micro": dict(model_dim=64, num_layers=4, num_heads=4, mlp_dim=128),
  "tiny": dict(model_dim=192, num_layers=12, num_heads=3, mlp_dim=768),
  "small": dict(model_dim=384, num_layers=12, num_heads=6, mlp_dim=1536),
}


class ViT(AttentionFields):
  """``images float [batch, height, width, channels]`` → logits ``[batch, num_classes]``.

  Attributes:
    num_classes: output classes. patch_size: square patch side (height and width must divide).
    model_dim, num_layers, num_heads, mlp_dim: sizes (see ``VIT_PRESETS``).
    attention, attention_options: kernel by registry name.
    dropout_rate, attention_dropout_rate: dropout.
    dtype, param_dtype: compute and parameter dtypes (``AttentionFields``); logits are float32.
  """

  num_classes: int
  patch_size: int = 16
  model_dim: int = 192
  num_layers: int = 12
  num_heads: int = 3
  mlp_dim: int = 768

  @nn.compact
  def __call__(self, images, mask=None, *, train: bool = False, sow_weights: bool = False):
    del mask  # images have no padding
    if images.ndim != 4:
      raise ValueError(f"ViT expects images [batch, height, width, channels]; got {images.shape}")
    height, width = images.shape[1:3]
    if height % self.patch_size or width % self.patch_size:
      raise ValueError(
        f"image size {height}x{width} is not divisible by patch_size={self.patch_size}"
      )
    x = nn.Conv(
      self.model_dim,
      (self.patch_size,) * 2,
      strides=(self.patch_size,) * 2,
      padding="VALID",
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      name="patch_embedding",
    )(images)
    batch, grid_h, grid_w, _ = x.shape
    x = x.reshape((batch, grid_h * grid_w, self.model_dim))
    cls = self.param("cls", nn.initializers.zeros_init(), (1, 1, self.model_dim), self.param_dtype)
    x = jnp.concatenate([jnp.broadcast_to(cls, (batch, 1, self.model_dim)).astype(x.dtype), x], 1)
    positions = self.param(
      "positions", nn.initializers.normal(0.02), (1, x.shape[1], self.model_dim), self.param_dtype
    )
    x = Dropout(self.dropout_rate)(x + positions.astype(x.dtype), deterministic=not train)
    context = {"grid_shape": (grid_h, grid_w), "num_prefix_tokens": 1}
    for i in range(self.num_layers):
      x = EncoderBlock(
        num_heads=self.num_heads,
        mlp_dim=self.mlp_dim,
        attention_context=context,
        pre_norm=True,
        name=f"block_{i}",
        **self.attention_fields(),
      )(x, train=train, sow_weights=sow_weights)
    x = nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, name="final_norm")(x)
    head = nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype, name="head")
    return head(x[:, 0]).astype(jnp.float32)
