"""Memory-efficient mixed precision (``amp.*``): float32 master weights, bfloat16 compute.

    epl.init({"amp.level": "O1"})                         # loss_scale "dynamic" by default
    epl.init({"amp.level": "O1", "amp.loss_scale": 128})  # a fixed scale

O1 is an op policy over the traced forward (applied by ``uses.ParamUses``): matmuls and
convolutions run in the compute dtype, numerically sensitive ops (exp, log, division, powers,
reductions, softmax pieces) in float32, and everything else in the widest dtype of its operands
(a parameter-derived operand follows the others: a bias added to a bfloat16 product is cast at
that use). The weights stay float32 in the state; a low-precision copy exists only inside the
op that uses it and is recomputed from the master weight in the backward pass, never stored.
Outputs keep their traced dtypes, so the loss and the updated model state are float32.

The compute dtype is **bfloat16**: its exponent range is float32's, so gradients do not
underflow and no loss scale is needed (the reason float16 needs one). ``amp.loss_scale`` is
still honoured: the loss is multiplied by the scale before differentiation (features.LOSS_SCALE)
and the gradients divided by it; with "dynamic" the scale starts at 2**15, is halved and the
update skipped when a gradient is not finite, and doubled after 2000 finite steps in a row.
With bfloat16 a power-of-two scale changes no value, so it acts as a guard that skips steps
with non-finite gradients. ``MixedPrecision(..., compute_dtype=jnp.float16)`` gives EPL's
float16 behaviour, where the scale matters. ``metrics["amp_skipped_steps"]`` counts skipped
steps and ``metrics["loss_scale"]`` shows the scale; ``amp.debug_log`` logs every change.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from epljax.config import AmpConfig
from epljax.features import LOSS_SCALE, BuildContext, Feature, GradientFn, UpdateFn
from epljax.sharding.program import MATMULS

log = logging.getLogger("epljax.amp")

DYNAMIC_START = 2.0 ** 15
GROWTH_INTERVAL = 2000
COMPUTE_DTYPE = jnp.bfloat16

# The op policy.
LOW = MATMULS
HIGH = frozenset({
    "exp", "exp2", "log", "log1p", "expm1", "pow", "integer_pow", "square", "sqrt", "rsqrt",
    "cbrt", "div", "rem", "erf", "erfc", "erf_inv", "lgamma", "digamma", "igamma", "logistic",
    "tan", "sin", "cos", "atan2", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh",
    "atanh", "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp",
})
FOLLOW = frozenset({
    "add", "add_any", "sub", "mul", "neg", "max", "min", "abs", "sign", "select_n", "clamp",
    "tanh", "floor", "ceil", "round", "is_finite", "eq", "ne", "lt", "le", "gt", "ge",
    "broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "slice",
    "dynamic_slice", "dynamic_update_slice", "concatenate", "pad", "gather", "scatter-add",
    "scatter_add", "scatter", "reduce_max", "reduce_min", "argmax", "argmin", "copy", "copy_p",
    "rev", "cummax", "cummin", "stop_gradient", "name", "sharding_constraint", "split",
    "optimization_barrier", "device_put", "nextafter", "reduce_and", "reduce_or", "not",
    "and", "or", "xor",
})
SHAPE_ONLY = frozenset({"broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims",
                        "slice", "copy", "copy_p", "rev", "convert_element_type"})


def is_float(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def cast(x, dtype):
  return jax.lax.convert_element_type(x, dtype) if is_float(x) and x.dtype != dtype else x


class Policy:
  """Which dtype each equation runs in (see the module docstring)."""

  def __init__(self, compute_dtype):
    self.low = jnp.dtype(compute_dtype)

  def operands(self, step, invals, param_like) -> list:
    """``invals`` cast for ``step``; ``param_like[i]``: operand i derives from a parameter."""
    prim = step.primitive
    if prim in LOW:
      return [cast(v, self.low) for v in invals]
    if prim == "convert_element_type":
      return invals
    if prim in HIGH or prim not in FOLLOW:   # (unknown or higher-order: exactly as traced)
      return [cast(v, step.in_aval(i).dtype) for i, v in enumerate(invals)]
    leaders = [v for i, v in enumerate(invals) if is_float(v) and not param_like[i]
               and not getattr(step.in_aval(i), "weak_type", False)
               and not isinstance(step.inputs[i], jcore.Literal)]
    if leaders and all(v.dtype == self.low for v in leaders):
      return [cast(v, self.low) for v in invals]
    widest = [step.in_aval(i).dtype for i in range(len(invals))]
    return [cast(v, widest[i]) if is_float(v) else v for i, v in enumerate(invals)]

  def low_params(self, step) -> dict:
    pet = step.eqn.params.get("preferred_element_type")
    if pet is not None and jnp.issubdtype(pet, jnp.floating):
      return {"preferred_element_type": self.low}
    return {}


# -- loss scaling ------------------------------------------------------------------------------

class LossScale(Feature):
  """The loss scale (``fstate[LOSS_SCALE]``, float32): gradients are unscaled here."""

  name = LOSS_SCALE

  def __init__(self, config: AmpConfig):
    self.initial = DYNAMIC_START if config.loss_scale == "dynamic" else float(config.loss_scale)

  def init_state(self, ctx: BuildContext) -> Any:
    return jnp.asarray(self.initial, jnp.float32)

  def gradients(self, fn: GradientFn, ctx: BuildContext) -> GradientFn:
    def unscaled(params, model_state, micro, fstate):
      loss, aux, grads, new_state = fn(params, model_state, micro, fstate)
      inv = 1.0 / fstate[LOSS_SCALE]
      return loss, aux, jax.tree.map(lambda g: g * inv.astype(g.dtype), grads), new_state

    return unscaled

  def metrics(self, fstate: Any) -> dict[str, Any]:
    return {"loss_scale": fstate}

  def describe(self) -> str:
    return ""


class MixedPrecision(Feature):
  """``amp.level="O1"``: the op policy (used by ``uses.ParamUses``), skipping non-finite
  updates and adjusting the loss scale."""

  name = "amp"

  def __init__(self, config: AmpConfig, compute_dtype=None,
               growth_interval: int = GROWTH_INTERVAL):
    self.dynamic = config.loss_scale == "dynamic"
    self.debug_log = config.debug_log
    self.policy = Policy(COMPUTE_DTYPE if compute_dtype is None else compute_dtype)
    self.growth_interval = growth_interval
    self.loss_scale = LossScale(config)

  def init_state(self, ctx: BuildContext) -> Any:
    return {"good_steps": jnp.zeros((), jnp.int32), "skipped": jnp.zeros((), jnp.int32)}

  def update(self, fn: UpdateFn, ctx: BuildContext) -> UpdateFn:
    def guarded(params, opt_state, grads, fstate):
      finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
      # A cond, not a select: the update runs in place, or not at all.
      old = (params, opt_state, fstate)
      params, opt_state, fstate = jax.lax.cond(
          finite, lambda: _in_memory_of(fn(params, opt_state, grads, fstate), old),
          lambda: old)
      scale, stats = fstate[LOSS_SCALE], fstate[self.name]
      new_scale, good = next_scale(scale, stats["good_steps"], finite, self.dynamic,
                                   self.growth_interval)
      if self.debug_log:
        jax.debug.callback(_log_step, finite, scale, new_scale)
      stats = {"good_steps": good,
               "skipped": stats["skipped"] + jnp.logical_not(finite).astype(jnp.int32)}
      return params, opt_state, {**fstate, LOSS_SCALE: new_scale, self.name: stats}

    return guarded

  def metrics(self, fstate: Any) -> dict[str, Any]:
    return {"amp_skipped_steps": fstate["skipped"]}

  def describe(self) -> str:
    scale = "dynamic loss scale (2**15, x0.5 on overflow, x2 after " \
        f"{self.growth_interval} good steps)" if self.dynamic else \
        f"fixed loss scale {self.loss_scale.initial:g}"
    return (f"mixed precision O1: float32 master weights, {self.policy.low.name} compute "
            f"cast at use; {scale}; non-finite steps skipped")


def _in_memory_of(new, old):
  """``new`` moved to the memory (device or host) each leaf of ``old`` is in: both branches
  of the skip must have one type, and a value's memory space is part of its type."""
  def move(n, o):
    space = jax.typeof(o).memory_space
    return n if jax.typeof(n).memory_space == space else jax.device_put(n, space)
  return jax.tree.map(move, new, old)


def next_scale(scale, good_steps, finite, dynamic: bool, growth_interval: int):
  """The loss scale and count of consecutive finite steps after one step."""
  if not dynamic:
    return scale, jnp.where(finite, good_steps + 1, 0)
  good = jnp.where(finite, good_steps + 1, 0)
  grow = good >= growth_interval
  new = jnp.where(finite, jnp.where(grow, scale * 2.0, scale), scale * 0.5)
  new = jnp.maximum(new, 1.0).astype(jnp.float32)
  return new, jnp.where(grow, 0, good)


def _log_step(finite, scale, new_scale):
  if not finite:
    log.warning("amp: non-finite gradients, step skipped; loss scale %g -> %g",
                float(scale), float(new_scale))
  elif float(new_scale) != float(scale):
    log.info("amp: loss scale %g -> %g", float(scale), float(new_scale))
