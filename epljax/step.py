"""The pieces of one training step, composed by the Trainer.

    step = update(gradients(forward))

- ``forward``: ``(params, model_state, batch, fstate) -> (loss, aux, new_model_state)`` of one
  micro batch: the user's loss, wrapped by the features' ``forward`` hooks;
- ``accumulate_gradients``: value and gradient over ``num_micro_batch`` micro batches (a
  ``lax.scan``; one micro batch is a plain call), averaged as EPL does. The reduction over
  replicas is GSPMD's: the gradient of a loss traced over the whole batch is already the mean
  over replicas;
- ``apply_optimizer``: the optax update, applied only when the step is finite.

Features (``epljax.features``) wrap each piece; ``train_step`` chains them.

Non-finite steps: ``train_step`` checks the loss and the reduced gradients; when any is not
finite the update is not applied (parameters and optimizer state come back bit for bit) and
``metrics["finite"]`` is False; ``TrainState.feature_state[NONFINITE_RUN]`` counts such steps
in a row (the Trainer reads it rarely, to enforce ``max_nonfinite_steps``; a restored state
carries its run). The verdict travels to ``apply_optimizer`` under ``fstate[STEP_FINITE]`` for
the update alone (it is not kept in the state), so the skip sits innermost, inside what
features do around the update (ZeRO's layouts, offload's memory spaces), and features that
react to overflow themselves (the dynamic loss scale) still see the non-finite gradients.

How the check and the skip are compiled depends on the platform (``SKIP_BY_COND``): on GPU and TPU
a select fused into each update kernel and one masked reduction per gradient; on XLA:CPU,
whose fusion cannot do either for free, a ``lax.cond`` over the update and a plain sum of
squares (bench/overhead.py: 1.49x -> 1.0x a hand-written step). Both give the same bits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from epljax.features import BuildContext, Feature, ForwardFn, GradientFn, UpdateFn, loss_scale

STEP_FINITE = "step_finite"   # fstate key of the update's "apply this step" flag (module doc)
NONFINITE_RUN = "nonfinite_run"   # fstate key: non-finite steps in a row, up to the last one


@flax.struct.dataclass
class TrainState:
  """Everything that changes from step to step, as global (sharded) arrays.

  ``params`` are what the optimizer trains; ``model_state`` the rest of the variables (BatchNorm
  statistics, NNX RNG counters); ``feature_state`` the state of optional features (the loss
  scale of mixed precision), keyed by feature name.
  """
  step: jax.Array
  params: Any
  opt_state: Any
  model_state: Any
  feature_state: dict = flax.struct.field(default_factory=dict)


def accumulate_gradients(forward: ForwardFn, num_micro_batch: int) -> GradientFn:
  """Gradients of the loss over micro batches (leading axis of ``micro``), averaged."""

  def value_and_grad(params, model_state, batch, fstate):
    scale = loss_scale(fstate)

    def scalar(p):
      loss, aux, new_state = forward(p, model_state, batch, fstate)
      seed = loss if scale is None else loss * scale.astype(loss.dtype)
      return seed, (loss, aux, new_state)

    (_, (loss, aux, new_state)), grads = jax.value_and_grad(scalar, has_aux=True)(params)
    return loss, aux, grads, new_state

  def gradients(params, model_state, micro, fstate):
    if num_micro_batch == 1:
      return value_and_grad(params, model_state, jax.tree.map(lambda x: x[0], micro), fstate)

    def body(carry, batch):
      grad_sum, state = carry
      loss, aux, grads, state = value_and_grad(params, state, batch, fstate)
      return (jax.tree.map(jnp.add, grad_sum, in_device_memory(grads)), state), (loss, aux)

    zeros = jax.tree.map(jnp.zeros_like, params)
    (grad_sum, new_state), (losses, auxes) = jax.lax.scan(body, (zeros, model_state), micro)
    grads = jax.tree.map(lambda g: g / num_micro_batch, grad_sum)
    return jnp.mean(losses), auxes, grads, new_state

  return gradients


def in_device_memory(tree: Any) -> Any:
  """The gradients of offloaded (host) parameters are host values; the sum over micro batches
  is kept in device memory, where the update reads it."""
  def move(x):
    if getattr(jax.typeof(x), "memory_space", jax.memory.Space.Device) == jax.memory.Space.Device:
      return x
    return jax.device_put(x, jax.memory.Space.Device)

  return jax.tree.map(move, tree)


def map_optimizer_state(optimizer: optax.GradientTransformation, fn: Callable[[Any, Any], Any],
                        state: Any, params_like: Any, *, non_params: Callable | None = None,
                        is_leaf: Callable[[Any], bool] | None = None) -> Any:
  """``optax.tree_map_params`` that also takes states with masked parts (``multi_transform``,
  masked weight decay): their ``MaskedNode``s, empty subtrees, are kept as they are."""
  def masked(x):
    return isinstance(x, optax.MaskedNode)

  def mapped():
    return optax.tree_map_params(
        optimizer, lambda v, p: v if masked(v) else fn(v, p), state, params_like,
        transform_non_params=non_params,
        is_leaf=lambda x: masked(x) or (is_leaf is not None and is_leaf(x)))

  # The optimizer's init that tree_map_params calls runs on abstract values (its zeros would
  # otherwise be computed: a compile and a device array per call); a tree of shardings comes
  # out unchanged. Arrays in ``state`` (left as they are, no ``non_params``) need the eager way.
  found = []
  jax.eval_shape(lambda: found.append(mapped()))
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(found[0])):
    return mapped()
  return found[0]


SKIP_BY_COND = ("cpu",)   # platforms whose step skips by lax.cond (module doc)


def skips_by_cond(mesh: jax.sharding.Mesh, features: Sequence[Feature], *,
                  state_on_device: bool) -> bool:
  """Whether the step over ``mesh`` checks and skips the XLA:CPU way (module doc): not for
  state in host memory (a value's memory space is part of its type, which a cond's branches
  must agree on), nor under a feature that rewrites the update. Pipeline stages too: every
  device takes the cond's same branch (the pipeline refuses collectives in its loop's stage
  branches only, ``Pipeline.check_compiled``)."""
  return (mesh.devices.flat[0].platform in SKIP_BY_COND and state_on_device
          and not any(f.rewrites_update for f in features))


def describe_skip(by_cond: bool) -> str:
  """The plan's line on how a non-finite step is skipped."""
  if by_cond:
    return ("non-finite steps: skipped by a lax.cond over the update (XLA:CPU; on GPU/TPU a "
            "select fused into the update)")
  return "non-finite steps: skipped by a select fused into the update"


WAIT_EACH_STEP = ("cpu",)   # platforms where the Trainer keeps two steps in flight at most


def waits_each_step(mesh: jax.sharding.Mesh) -> bool:
  """Whether ``Trainer.train_step`` waits for the previous step once it has queued the next.

  XLA:CPU runs every device's part of a step on one shared thread pool: with many steps queued,
  the parts of one collective can be starved out of its rendezvous, which XLA ends by aborting
  the process after 40 s (seen with 200 queued steps of a hand-written ``jax.jit`` on 8
  simulated devices and 2 cores). GPU and TPU steps queue freely.
  """
  return mesh.devices.flat[0].platform in WAIT_EACH_STEP and mesh.devices.size > 1


def describe_wait(waits: bool) -> str | None:
  """The plan's line on the host's pace, where it waits."""
  return ("host: at most two steps in flight (XLA:CPU, whose collectives starve with many "
          "queued; GPU/TPU: no wait)") if waits else None


def apply_optimizer(optimizer: optax.GradientTransformation, by_cond: bool = False) -> UpdateFn:
  def apply(params, opt_state, grads):
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_opt_state

  def update(params, opt_state, grads, fstate):
    finite = fstate.get(STEP_FINITE)
    if finite is None:
      return (*apply(params, opt_state, grads), fstate)
    if by_cond:
      # XLA:CPU keeps the old and new state live across a select, with a copy of each
      # optimizer leaf; a cond runs the update in place or not at all.
      new_params, new_opt_state = jax.lax.cond(
          finite, apply, lambda p, o, _: (p, o), params, opt_state, grads)
      return new_params, new_opt_state, fstate
    # A select fuses into the update and runs wherever the update runs (on the host under
    # offload v1), and a skipped step keeps the old bits.
    new_params, new_opt_state = apply(params, opt_state, grads)
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    return (jax.tree.map(keep, new_params, params),
            jax.tree.map(keep, new_opt_state, opt_state), fstate)

  return update


def build(forward: ForwardFn, make_gradients: Callable[[ForwardFn], GradientFn],
          optimizer: optax.GradientTransformation, features: Sequence[Feature],
          ctx: BuildContext, by_cond: bool = False) -> tuple[ForwardFn, GradientFn, UpdateFn]:
  """Chains the features around forward, gradients and update (``by_cond``: module doc)."""
  for f in features:
    forward = f.forward(forward, ctx)
  gradients = make_gradients(forward)
  for f in features:
    gradients = f.gradients(gradients, ctx)
  update = apply_optimizer(optimizer, by_cond)
  for f in features:
    update = f.update(update, ctx)
  return forward, gradients, update


def train_step(gradients: GradientFn, update: UpdateFn, features: Sequence[Feature],
               prepare_batch: Callable[[Any], Any], has_aux: bool, by_cond: bool = False,
               grad_layouts: Any = None):
  """``(state, batch) -> (state, metrics)`` from its pieces; ``grad_layouts``: the reduced
  gradients' shardings (a tree like ``params``), which ``norm_and_finite`` groups by."""

  def step(state: TrainState, batch: Any):
    fstate = state.feature_state
    loss, aux, grads, model_state = gradients(state.params, state.model_state,
                                              prepare_batch(batch), fstate)
    grad_norm, finite = norm_and_finite(loss, grads, by_cond, grad_layouts)
    run = jnp.where(finite, 0, fstate[NONFINITE_RUN] + 1)
    params, opt_state, fstate = update(state.params, state.opt_state, grads,
                                       {**fstate, STEP_FINITE: finite})
    fstate = {k: v for k, v in fstate.items() if k != STEP_FINITE}
    fstate[NONFINITE_RUN] = run
    # Model state (BatchNorm statistics) of a non-finite step is not kept either.
    model_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), model_state,
                               state.model_state)
    metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite,
               "step": state.step + 1}
    if has_aux:
      metrics["aux"] = aux
    for f in features:
      metrics.update(f.metrics(fstate.get(f.name)))
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                         model_state=model_state, feature_state=fstate), metrics

  return step


def norm_and_finite(loss: jax.Array, grads: Any, by_cond: bool = False,
                    layouts: Any = None) -> tuple[jax.Array, jax.Array]:
  """The global norm of the gradients (float32), and whether the loss and every gradient are
  finite, from one reduction per group of leaves.

  Each element's square is summed in float32. A sum is NaN iff some element is NaN or
  infinite (checked in the leaf's own dtype: a float64 1e300 is finite, its float32 cast is
  not), while finite elements whose squares overflow give ``+inf``, never NaN (the terms are
  >= 0). So the flag is per element, as a separate ``all(isfinite(g))`` would be, at half the
  reductions.

  Leaves of one shape, dtype and layout (``layouts``: their shardings, a tree like ``grads``;
  None: every leaf alone) are added elementwise before one reduction, in groups of at most
  ``NORM_GROUP``: the same bytes are read, in a fraction of the kernels. A model whose layers
  are a Python loop has a reduction per distinct weight, not per weight: the 48-layer loop GPT
  of ``bench/pipeline.py compile --baseline`` compiles its 4-stage pipeline step for 8 H100s in
  95.6 s instead of 148.6 s (HLO 8813 -> 7332 kchars; bench/RESULTS.md), the data-parallel
  step's temp and bytes accessed are unchanged or lower on XLA:CPU and XLA:GPU.

  GPU/TPU: NaN stands in for each non-finite element inside the reduction (one fused kernel).
  XLA:CPU (``by_cond``): that select splits the reduction in two kernels there, so the plain
  squares are summed (an infinite element then gives ``+inf`` too), and only a sum of ``+inf``
  is told apart, by an elementwise check under a ``lax.cond`` that runs for such steps alone.
  """
  leaves = jax.tree.leaves(in_device_memory(grads))
  if not leaves:
    return jnp.zeros((), jnp.float32), jnp.isfinite(loss)
  groups = _same_layout(leaves, layouts)

  def total(term):   # sum over all groups of one reduction of the group's terms added
    return sum(jnp.sum(functools.reduce(jnp.add, map(term, group))) for group in groups)

  if not by_cond:
    squares = total(lambda g: jnp.where(jnp.isfinite(g), jnp.square(g.astype(jnp.float32)),
                                        jnp.nan))
    return jnp.sqrt(squares), jnp.logical_and(jnp.isfinite(loss), ~jnp.isnan(squares))
  squares = total(lambda g: jnp.square(g.astype(jnp.float32)))

  def elementwise():
    return functools.reduce(jnp.logical_and, [
        jnp.all(functools.reduce(jnp.logical_and, map(jnp.isfinite, group)))
        for group in groups])

  finite = jax.lax.cond(jnp.isinf(squares), elementwise, lambda: ~jnp.isnan(squares))
  norm = jnp.where(finite, jnp.sqrt(squares), jnp.nan)   # NaN for a non-finite one, as above
  return norm, jnp.logical_and(jnp.isfinite(loss), finite)


# Leaves added before one reduction at most, so that a fused reduction's inputs stay few.
NORM_GROUP = 32


def _same_layout(leaves: list[jax.Array], layouts: Any) -> list[list[jax.Array]]:
  """``leaves`` in groups of equal shape, dtype and sharding spec, in first-seen order."""
  shardings = (jax.tree.leaves(layouts, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
               if layouts is not None else [])
  if len(shardings) != len(leaves):   # no layouts (or not these gradients'): each leaf alone
    shardings = [None] * len(leaves)
  by_key: dict[Any, list[jax.Array]] = {}
  for i, (g, sharding) in enumerate(zip(leaves, shardings)):
    key = i if sharding is None else (g.shape, g.dtype, getattr(sharding, "spec", sharding))
    by_key.setdefault(key, []).append(g)
  return [group[i:i + NORM_GROUP] for group in by_key.values()
          for i in range(0, len(group), NORM_GROUP)]


def eval_step(forward: ForwardFn, prepare_batch: Callable[[Any], Any], has_aux: bool):
  """``(state, batch) -> metrics``: the loss (mean over micro batches) and aux of the forward
  pass alone; no gradient, no update, the state is not changed."""

  def evaluate(state: TrainState, batch: Any):
    micro = prepare_batch(batch)

    def one(b):
      loss, aux, _ = forward(state.params, state.model_state, b, state.feature_state)
      return loss, aux

    losses, auxes = jax.lax.map(one, micro)
    metrics = {"loss": jnp.mean(losses)}
    if has_aux:
      metrics["aux"] = (jax.tree.map(lambda x: x[0], auxes)
                        if jax.tree.leaves(micro)[0].shape[0] == 1 else auxes)
    return metrics

  return evaluate
