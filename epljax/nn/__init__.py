"""Layers and losses whose parallel form needs more than the split rules: a GShard/Switch
mixture of experts with all-to-all dispatch (``moe.py``) and a cross entropy that stays cheap on
split logits (``losses.py``)."""

from epljax.nn.losses import softmax_cross_entropy_with_integer_labels
from epljax.nn.moe import MoE, top_k_routing

__all__ = ["MoE", "softmax_cross_entropy_with_integer_labels", "top_k_routing"]
