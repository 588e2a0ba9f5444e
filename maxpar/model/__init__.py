"""Flax Linen model of maxpar."""

from maxpar.model.transformer import Transformer

__all__ = ["Transformer"]
