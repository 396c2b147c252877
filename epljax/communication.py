"""Communication options (``config.communication``) as features of the step.

GSPMD inserts the collectives; these features decide what is reduced and how:
- ``gradients_reduce_method``: ``"mean"`` is what GSPMD computes for a loss traced over the
  whole batch; ``"sum"`` multiplies the gradients by the number of replicas, which is EPL's sum
  all-reduce of per-replica mean gradients.
"""

from __future__ import annotations

import jax

from epljax.config import CommunicationConfig
from epljax.features import BuildContext, Feature, GradientFn


class ReduceSum(Feature):
  """``gradients_reduce_method="sum"``: gradients summed over replicas instead of averaged."""

  name = "reduce_sum"

  def gradients(self, fn: GradientFn, ctx: BuildContext) -> GradientFn:
    replicas = ctx.num_replicas

    def summed(params, model_state, micro, fstate):
      loss, aux, grads, new_state = fn(params, model_state, micro, fstate)
      return loss, aux, jax.tree.map(lambda g: g * replicas, grads), new_state

    return summed

  def describe(self) -> str:
    return "gradients summed over replicas (communication.gradients_reduce_method='sum')"


def features(config: CommunicationConfig) -> list[Feature]:
  """The communication features the configuration asks for, in the order they apply."""
  out: list[Feature] = []
  if config.gradients_reduce_method == "sum":
    out.append(ReduceSum())
  return out
