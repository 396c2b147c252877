"""Layers and losses whose parallel form needs more than the split rules: a GShard/Switch
mixture of experts with all-to-all dispatch (``moe.py``), a cross entropy that stays cheap on
split logits (``losses.py``) and attention in memory linear in the sequence (``attention.py``;
its building blocks in ``blocks.py``, its kernel in ``flash.py``, over the ``context`` axis in
``context.py``)."""

from epljax.nn.attention import dot_product_attention
from epljax.nn.blocks import attention_block, merge_partials
from epljax.nn.losses import softmax_cross_entropy_with_integer_labels
from epljax.nn.moe import MoE, top_k_routing

__all__ = ["MoE", "attention_block", "dot_product_attention", "merge_partials",
           "softmax_cross_entropy_with_integer_labels", "top_k_routing"]
