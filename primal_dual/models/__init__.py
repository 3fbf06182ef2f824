"""Models built from ``primal_dual.layers.MultiHeadAttention``."""

from primal_dual.models.encoder import EncoderClassifier
from primal_dual.models.sequence import SequenceTransformer
from primal_dual.models.vit import VIT_PRESETS, ViT

__all__ = ["EncoderClassifier", "SequenceTransformer", "ViT", "VIT_PRESETS"]
