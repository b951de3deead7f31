"""Attention backends: they read and write K/V through block tables."""

from pdinfer.layers.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSeq

__all__ = ["AttentionMetadata", "DecodeGroup", "PrefillSeq"]
