"""A zoo of tiny models with the structure of real model families, written here (none of their
code): what a new user brings to epljax. Each entry is a ``ZooModel``; ``ZOO`` maps names to them.

- ``gemma``: fused einsum q/kv/out kernels, grouped-query attention, RMSNorm, gated MLP, tied
  embedding, alternating local/global attention.
- ``llama``: layers under ``nn.scan``, Flax logical axis names on every parameter, separate
  q/k/v/o, SwiGLU, untied head.
- ``gpt2``: Dense q/k/v, LayerNorm, GELU MLP, learned positions, tied embedding.
- ``gpt2_fused``: GPT-2 as Hugging Face writes it, one fused ``c_attn`` ``(C, 3C)`` Conv1D
  split in three; ``gpt2_fused_t`` the same with every kernel stored ``(out, in)`` and read
  transposed (``FlaxConv1D``, nanoGPT's ``nn.Linear``).
- ``vit``: convolutional patch embedding, class token, encoder blocks, classification head.
- ``mlp_loop``: a residual MLP stack built in a Python loop inside one module.

``ZooModel.megatron`` says, per parameter path (regular expressions, full match), the
PartitionSpec Megatron-style tensor parallelism gives it over the mesh axis ``"model"``:
attention split by heads (the output projection on its heads dimension, i.e. row), MLPs column
then row, embeddings by vocabulary, norms replicated. ``expected_specs`` turns that into a
tree like the variables.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import jax
from flax.core import meta
from jax.sharding import PartitionSpec as P

import epljax as epl

# The models the examples train too (the Llama) live in examples/example_models.
_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "examples")
if _EXAMPLES not in sys.path:
  sys.path.append(_EXAMPLES)

from models import common, gemma, gpt2, gpt2_fused, llama, mlp_loop, vit


@dataclasses.dataclass(frozen=True)
class ZooModel:
  name: str
  init_fn: Callable[[Any, dict], Any]        # (rng, batch) -> variables
  loss_fn: Callable[[Any, dict], Any]        # (variables, batch) -> mean loss
  make_batch: Callable[[int], dict]          # rows -> deterministic numpy batch
  annotate_pattern: str                      # module-path regex a user splits for Megatron TP
  megatron: dict[str, tuple]                 # parameter path regex -> expected spec entries
  logical_rules: tuple | None = None         # Flax logical axis rules, when the model has names
  deep: bool = False                         # 1e-4 instead of 1e-5
  # Module-path regexes of two consecutive split(2) pipeline stages (what no rule matches
  # follows its data); empty when the layers have no boundary a path can name (nn.scan, one
  # module).
  stage_splits: tuple[str, ...] = ()

  def annotate_rules(self, device_count: int = 2) -> dict:
    """The one-line ``epl.annotate`` a user writes: ``{pattern: epl.split(device_count)}``."""
    return {self.annotate_pattern: epl.split(device_count)}

  def stage_split_rules(self, device_count: int = 2) -> dict:
    """The ``epl.annotate`` of ``stage_splits``: stage ``i`` is ``epl.split(device_count)``."""
    return {pattern: epl.split(device_count, name=f"stage_{i}")
            for i, pattern in enumerate(self.stage_splits)}

  def expected_spec(self, path: str) -> P:
    """The Megatron spec of the parameter at ``path`` (as the plan prints paths)."""
    hits = [spec for pattern, spec in self.megatron.items() if re.fullmatch(pattern, path)]
    if len(hits) != 1:
      raise KeyError(f"{self.name}: {len(hits)} Megatron expectations match {path!r}")
    return P(*hits[0])

  def expected_specs(self, variables) -> dict[str, P]:
    """``{path: spec}`` for every parameter of ``variables`` (boxed or not)."""
    leaves = jax.tree_util.tree_flatten_with_path(meta.unbox(variables))[0]
    return {path: self.expected_spec(path) for path in (keypath(k) for k, _ in leaves)}


def keypath(path) -> str:
  """A tree path as the plan prints it: ``params/layer_0/attn/q_einsum/w``."""
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


ZOO: dict[str, ZooModel] = {
    "gemma": ZooModel(
        "gemma", gemma.init_fn, gemma.loss_fn,
        lambda rows: common.token_batch(rows, 16, gemma.VOCAB),
        gemma.ANNOTATE, gemma.MEGATRON, deep=True,
        stage_splits=("Gemma/layer_[01]", "Gemma/(layer_[23]|final_norm)")),
    "llama": ZooModel(
        "llama", llama.init_fn, llama.loss_fn,
        lambda rows: common.token_batch(rows, 16, llama.VOCAB),
        llama.ANNOTATE, llama.MEGATRON, logical_rules=llama.LOGICAL_RULES, deep=True),
    "gpt2": ZooModel(
        "gpt2", gpt2.init_fn, gpt2.loss_fn,
        lambda rows: common.token_batch(rows, gpt2.LENGTH, gpt2.VOCAB),
        gpt2.ANNOTATE, gpt2.MEGATRON, stage_splits=("GPT2/(wpe|h_0)", "GPT2/(h_1|ln_f)")),
    **{name: ZooModel(
        name, gpt2_fused.init_fn_of(model), gpt2_fused.loss_fn_of(model),
        lambda rows: common.token_batch(rows, gpt2.LENGTH, gpt2.VOCAB),
        gpt2_fused.ANNOTATE, gpt2_fused.megatron(model.transposed),
        stage_splits=("GPT2/(wpe|h_0)", "GPT2/(h_1|ln_f)"))
       for name, model in (("gpt2_fused", gpt2_fused.GPT2(transposed=False)),
                           ("gpt2_fused_t", gpt2_fused.GPT2(transposed=True)))},
    "vit": ZooModel(
        "vit", vit.init_fn, vit.loss_fn,
        lambda rows: common.image_batch(rows, vit.SIZE, vit.CHANNELS, vit.CLASSES),
        vit.ANNOTATE, vit.MEGATRON,
        stage_splits=("ViT/(patch_embed|encoder_0)", "ViT/(encoder_1|ln_f|head)")),
    "mlp_loop": ZooModel(
        "mlp_loop", mlp_loop.init_fn, mlp_loop.loss_fn,
        lambda rows: common.regression_batch(rows, mlp_loop.FEATURES, mlp_loop.OUTPUTS),
        mlp_loop.ANNOTATE, mlp_loop.MEGATRON, deep=True),
}
