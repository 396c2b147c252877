"""The pieces of one training step, composed by the Trainer.

    step = update(reduce(gradients(loss)))

- ``accumulate_gradients``: value and gradient of the loss over ``num_micro_batch`` micro
  batches (a ``lax.scan``; one micro batch is a plain call), averaged as EPL does;
- the reduction over replicas is GSPMD's (the gradient of a loss traced over the whole batch
  is already the mean over replicas); ``gradients_reduce_method="sum"`` scales it by the
  number of replicas, which is what EPL's sum all-reduce gives;
- ``apply_optimizer``: the optax update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

LossCall = Callable[[Any, Any, Any], tuple[jax.Array, Any, Any]]
# (params, model_state, micro batches) -> (mean loss, aux, gradients, new model_state)
GradientFn = Callable[[Any, Any, Any], tuple[jax.Array, Any, Any, Any]]


@flax.struct.dataclass
class TrainState:
  """Everything that changes from step to step, as global (sharded) arrays.

  ``params`` are what the optimizer trains; ``model_state`` the rest of the variables (BatchNorm
  statistics, NNX RNG counters); ``feature_state`` the state of optional features (the loss
  scale of mixed precision).
  """
  step: jax.Array
  params: Any
  opt_state: Any
  model_state: Any
  feature_state: dict = flax.struct.field(default_factory=dict)


def accumulate_gradients(loss_call: LossCall, num_micro_batch: int) -> GradientFn:
  """Gradients of the loss over micro batches, averaged (gradient accumulation)."""

  def value_and_grad(params, model_state, batch):
    def scalar(p):
      loss, aux, new_state = loss_call(p, model_state, batch)
      return loss, (aux, new_state)
    (loss, (aux, new_state)), grads = jax.value_and_grad(scalar, has_aux=True)(params)
    return loss, aux, grads, new_state

  def gradients(params, model_state, micro):
    if num_micro_batch == 1:
      return value_and_grad(params, model_state, jax.tree.map(lambda x: x[0], micro))

    def body(carry, batch):
      grad_sum, state = carry
      loss, aux, grads, state = value_and_grad(params, state, batch)
      return (jax.tree.map(jnp.add, grad_sum, grads), state), (loss, aux)

    zeros = jax.tree.map(jnp.zeros_like, params)
    (grad_sum, new_state), (losses, auxes) = jax.lax.scan(body, (zeros, model_state), micro)
    grads = jax.tree.map(lambda g: g / num_micro_batch, grad_sum)
    return jnp.mean(losses), auxes, grads, new_state

  return gradients


def scale_gradients(gradients: GradientFn, factor: float) -> GradientFn:
  """Multiplies the gradients by ``factor`` (``gradients_reduce_method="sum"``)."""
  if factor == 1:
    return gradients

  def scaled(params, model_state, micro):
    loss, aux, grads, new_state = gradients(params, model_state, micro)
    return loss, aux, jax.tree.map(lambda g: g * factor, grads), new_state

  return scaled


def apply_optimizer(optimizer: optax.GradientTransformation, params: Any, opt_state: Any,
                    grads: Any) -> tuple[Any, Any]:
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def train_step(gradients: GradientFn, optimizer: optax.GradientTransformation,
               prepare_batch: Callable[[Any], Any], has_aux: bool):
  """``(state, batch) -> (state, metrics)`` from its pieces."""

  def step(state: TrainState, batch: Any):
    loss, aux, grads, model_state = gradients(state.params, state.model_state,
                                              prepare_batch(batch))
    params, opt_state = apply_optimizer(optimizer, state.params, state.opt_state, grads)
    metrics = {"loss": loss}
    if has_aux:
      metrics["aux"] = aux
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                         model_state=model_state), metrics

  return step
