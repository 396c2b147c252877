"""Gradient checkpointing (``gradient_checkpoint.*``): keep less of the forward pass, recompute
the rest in the backward pass.

    epl.init({"gradient_checkpoint.type": "auto"})        # repeated blocks, found in the trace
    epl.init({"gradient_checkpoint.type": "collection"})  # the tensors the model tags:
    h = epl.add_to_collection(h, "checkpoints")           #   (or just call it, TF style)

The forward hook traces whatever ``fn(params, *args)`` it wraps (the whole loss, or a
pipeline stage) and re-runs it segment by segment (``blocks``): a rematerialized segment keeps
only its inputs and is recomputed, after its output cotangents exist, in the backward pass
(``recompute``). Collectives, stateful random numbers and side effects always run once, and
task graphs after ``end_taskgraph`` are left alone. ``check_gradients`` compares, on the first
step, the gradients with and without checkpointing and raises when they differ.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from epljax import strategy as strategy_lib
from epljax.config import GradientCheckpointConfig
from epljax.errors import EPLError, StateError
from epljax.features import BuildContext, Feature, ForwardFn, GradientFn, UpdateFn
from epljax.memory import blocks, interpret
from epljax.memory.recompute import rematerialize

COLLECTION = "checkpoints"
TAG = "epl.checkpoints"
CHECK_RTOL = 1e-4     # gradients with and without GC agree to float32 reassociation noise


class GradientCheckError(EPLError, RuntimeError):
  """Gradients with and without gradient checkpointing differ (``check_gradients``)."""


def add_to_collection(x: Any, name: str) -> Any:
  """Tags ``x`` (an array or a tree of arrays) for ``gradient_checkpoint.type="collection"``.

  EPL's ``tf.add_to_collection("checkpoints", x)``: a tagged tensor is kept for the backward
  pass and what lies between tagged tensors is recomputed. Use the returned value, or call it
  only for its effect as in TensorFlow: both work, the tag is found in the traced program.
  When gradient checkpointing is not ``"collection"`` this returns ``x`` untouched.
  """
  if name != COLLECTION:
    raise EPLError(f"epl.add_to_collection(x, {name!r}): epljax knows one collection, "
                   f"{COLLECTION!r} (tensors kept by gradient_checkpoint.type='collection').")
  try:
    from epljax.env import Env
    kind = Env.get().config.gradient_checkpoint.type
  except StateError:
    return x
  if kind != "collection":
    return x
  return jax.tree.map(lambda v: checkpoint_name(v, TAG), x)


class GradientCheckpoint(Feature):
  """``gradient_checkpoint.type`` "auto" or "collection" (see the module docstring)."""

  name = "gradient_checkpoint"

  def __init__(self, config: GradientCheckpointConfig):
    self.config = config
    self._plain = False          # set while check_gradients traces the reference
    self._found = "not traced yet"
    self._warned = False
    self._paths: list[str] = []
    self._diffs = None      # the first step's relative differences, set while tracing

  # -- forward -------------------------------------------------------------------------------
  def forward(self, fn: ForwardFn, ctx: BuildContext) -> ForwardFn:
    platform = ctx.mesh.devices.flat[0].platform
    taskgraphs = ctx.capture.taskgraphs if ctx.capture is not None else ()

    def checkpointed(params, *args):
      if self._plain:
        return fn(params, *args)
      program, flat = interpret.trace(fn, params, args)
      segments = self._segments(program, taskgraphs)
      return run_segments(program, flat, segments, platform)

    return checkpointed

  def _segments(self, program: interpret.Program, taskgraphs) -> list[blocks.Segment]:
    if self.config.type == "collection":
      ranges, count = blocks.tagged_cuts(program, TAG)
      self._found = f"collection: {count} tagged tensors -> {len(ranges)} segments"
      if count == 0:
        ranges = []
        self._found = "collection: no tagged tensor, nothing rematerialized"
        if not self._warned:
          self._warned = True
          warnings.warn("gradient_checkpoint.type='collection' but no tensor is tagged with "
                        "epl.add_to_collection(x, 'checkpoints') in the traced forward; "
                        "nothing is rematerialized.", stacklevel=2)
    else:
      ranges, pattern = blocks.repeated_blocks(program)
      if ranges:
        self._found = f"auto: {len(ranges)} repeated blocks {pattern}"
      else:
        ranges = blocks.balanced_segments(program)
        self._found = (f"auto: no block repeated {blocks.MIN_REPEATS}+ times; "
                       f"{len(ranges)} memory-balanced segments (about sqrt(layers))")
    end = self.config.end_taskgraph
    tgs = blocks.step_taskgraphs(program, taskgraphs)
    keep = [end < 0 or tg is None or tg <= end for tg in tgs]
    return blocks.plan_segments(program, ranges, keep)

  # -- check_gradients -----------------------------------------------------------------------
  def gradients(self, fn: GradientFn, ctx: BuildContext) -> GradientFn:
    if not self.config.check_gradients:
      return fn

    def checked(params, model_state, micro, fstate):
      out = fn(params, model_state, micro, fstate)
      first = jnp.logical_not(fstate[self.name]["checked"])

      def compare(_):
        with self._without_gc(), strategy_lib.trace_session():
          reference = fn(params, model_state, micro, fstate)[2]
        return jnp.stack([_relative_diff(a, b) for a, b in
                          zip(jax.tree.leaves(out[2]), jax.tree.leaves(reference))])

      leaves = jax.tree_util.tree_flatten_with_path(out[2])[0]
      self._paths = [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in leaves]
      self._diffs = jax.lax.cond(first, compare,
                                 lambda _: jnp.zeros(len(self._paths), jnp.float32), None)
      return out

    return checked

  @contextlib.contextmanager
  def _without_gc(self):
    self._plain = True
    try:
      yield
    finally:
      self._plain = False

  def update(self, fn: UpdateFn, ctx: BuildContext) -> UpdateFn:
    if not self.config.check_gradients:
      return fn

    def mark_checked(params, opt_state, grads, fstate):
      params, opt_state, fstate = fn(params, opt_state, grads, fstate)
      state = {"checked": jnp.ones((), bool), "diffs": self._diffs}
      return params, opt_state, {**fstate, self.name: state}

    return mark_checked

  def init_state(self, ctx: BuildContext) -> Any:
    if not self.config.check_gradients:
      return None
    count = len(jax.tree.leaves(ctx.params_shape))
    return {"checked": jnp.zeros((), bool), "diffs": jnp.zeros(count, jnp.float32)}

  def metrics(self, fstate: Any) -> dict[str, Any]:
    return {} if fstate is None else {"gradient_check_diffs": fstate["diffs"]}

  def after_first_step(self, metrics: dict[str, Any]) -> None:
    if self.config.check_gradients:
      _raise_if_different(np.asarray(metrics["gradient_check_diffs"]), self._paths)

  def describe(self) -> str:
    end = self.config.end_taskgraph
    scope = "all task graphs" if end < 0 else f"task graphs 0..{end}"
    check = ", gradients checked on the first step" if self.config.check_gradients else ""
    return f"gradient checkpointing ({self._found}; {scope}{check})"


def run_segments(program: interpret.Program, flat_args, segments, platform: str) -> Any:
  """Evaluates ``program``, each rematerialized segment as one recomputed unit."""
  env = interpret.start_env(program, flat_args)
  for seg in segments:
    steps = program.steps[seg.start:seg.stop]
    if not seg.remat:
      interpret.run_steps(steps, env)
      continue
    inputs, outputs = interpret.live_across(program, seg.start, seg.stop)
    if not outputs:
      continue   # dead code: nothing later reads it

    def segment(*vals, steps=steps, inputs=inputs, outputs=outputs):
      local = dict(zip(inputs, vals))
      interpret.run_steps(steps, local)
      return [local[k] for k in outputs]

    values = rematerialize(segment, platform=platform)(*[env[k] for k in inputs])
    env.update(zip(outputs, values))
  return interpret.finish(program, env)


def _relative_diff(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  scale = jnp.maximum(jnp.max(jnp.abs(b)), jnp.finfo(jnp.float32).tiny)
  return jnp.max(jnp.abs(a - b)) / scale


def _raise_if_different(diffs, paths):
  bad = [(p, float(d)) for p, d in zip(paths, diffs) if not float(d) <= CHECK_RTOL]
  if bad:
    listing = ", ".join(f"{p} (max |diff| / max |grad| = {d:.2e})" for p, d in bad[:5])
    raise GradientCheckError(
        f"gradient_checkpoint.check_gradients: the gradients with and without gradient "
        f"checkpointing differ beyond {CHECK_RTOL:g} (relative) at {listing}. Something in "
        "the rematerialized forward is not a pure function of its inputs (a callback, a "
        "stateful generator); keep it out of the checkpointed task graphs "
        "(gradient_checkpoint.end_taskgraph) or make it deterministic.")


def features(config: GradientCheckpointConfig) -> list[Feature]:
  return [GradientCheckpoint(config)] if config.type else []
