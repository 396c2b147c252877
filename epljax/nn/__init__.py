"""Layers whose parallel form needs more than the split rules: a GShard/Switch mixture of
experts (``moe.py``)."""

from epljax.nn.moe import MoE, top_k_routing

__all__ = ["MoE", "top_k_routing"]
