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

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore

from epljax import strategy as strategy_lib
from epljax.config import GradientCheckpointConfig
from epljax.errors import EPLError, PlanError, StateError
from epljax.features import BuildContext, Feature, ForwardFn, GradientFn, UpdateFn
from epljax.memory import blocks
from epljax.memory.recompute import rematerialize
from epljax.mesh import STAGE
from epljax.sharding.program import (Steps, bind, finish, in_context, live_across, run_scan,
                                     run_steps, scan_body, start_env, trace_steps)

COLLECTION = "checkpoints"
TAG = "epl.checkpoints"
CHECK_RTOL = 1e-4     # gradients with and without GC agree to float32 reassociation noise
NO_BLOCKS = ("gradient_checkpoint.type='auto' found no place to cut the traced forward into "
             "blocks (no position where fewer activations are live than in the whole "
             "program) and no scanned layers; nothing is rematerialized. Tag the tensors to "
             "keep with epl.add_to_collection and use type='collection'.")


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
    self._diffs = None      # the first step's relative differences (host, numpy)

  # -- forward -------------------------------------------------------------------------------
  def forward(self, fn: ForwardFn, ctx: BuildContext) -> ForwardFn:
    platform = ctx.mesh.devices.flat[0].platform
    taskgraphs = ctx.capture.taskgraphs if ctx.capture is not None else ()
    rules = ctx.capture.module_rules if ctx.capture is not None else ()   # as it applied them
    offload = self.config.offload_activations

    def checkpointed(params, *args):
      if self._plain:
        return fn(params, *args)
      program, flat = trace_steps(fn, params, args)
      segments, loops = self._segments(program, taskgraphs, rules)
      return run_segments(program, flat, segments, loops, platform=platform, offload=offload)

    return checkpointed

  def _segments(self, program: Steps, taskgraphs, rules=()):
    end = self.config.end_taskgraph
    tgs = blocks.step_taskgraphs(program, taskgraphs, rules)
    keep = [end < 0 or tg is None or tg <= end for tg in tgs]
    loops = frozenset(i for i in blocks.scan_bodies(program) if keep[i])
    found = [f"{len(loops)} scanned layer bodies rematerialized per iteration"] if loops else []
    if self.config.type == "collection":
      ranges, count = blocks.tagged_cuts(program, TAG)
      if count:
        found.insert(0, f"{count} tagged tensors -> {len(ranges)} segments")
      else:
        ranges = []
        self._warn_once("gradient_checkpoint.type='collection' but no tensor is tagged with "
                        "epl.add_to_collection(x, 'checkpoints') in the traced forward; "
                        "nothing is rematerialized.")
        found.insert(0, "no tagged tensor")
    else:
      cuts = blocks.structural_cuts(program)
      ranges = cuts.ranges
      if ranges:
        found.insert(0, f"{len(ranges)} segments cut where little is live ({cuts.pattern}); "
                     f"estimated activations {_mib(cuts.kept_bytes + cuts.segment_bytes)} of "
                     f"{_mib(cuts.total_bytes)}")
      elif not loops:
        self._warn_once(NO_BLOCKS)
        found.append("no blocks found: nothing rematerialized")
    self._found = f"{self.config.type}: " + "; ".join(found or ["nothing to rematerialize"])
    return blocks.plan_segments(program, ranges, keep), loops

  def _warn_once(self, message: str):
    if not self._warned:
      self._warned = True
      warnings.warn(message, stacklevel=3)

  # -- check_gradients -----------------------------------------------------------------------
  # On the first step the gradients are computed again without checkpointing and compared on
  # the device; the relative differences reach the host by a callback (``_record``), and
  # ``after_first_step`` raises. Only ``checked`` lives in the feature state.
  def gradients(self, fn: GradientFn, ctx: BuildContext) -> GradientFn:
    if not self.config.check_gradients:
      return fn
    stages = ctx.mesh.shape.get(STAGE, 1)
    if stages > 1:
      raise PlanError(_CHECK_WITH_STAGES.format(s=stages))

    def checked(params, model_state, micro, fstate):
      out = fn(params, model_state, micro, fstate)

      def compare(_):
        self._plain = True
        try:
          with strategy_lib.trace_session():
            reference = fn(params, model_state, micro, fstate)[2]
        finally:
          self._plain = False
        jax.debug.callback(self._record, jnp.stack([
            _relative_diff(a, b) for a, b in zip(jax.tree.leaves(out[2]),
                                                 jax.tree.leaves(reference))]))

      leaves = jax.tree_util.tree_flatten_with_path(out[2])[0]
      self._paths = [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in leaves]
      jax.lax.cond(jnp.logical_not(fstate[self.name]["checked"]), compare, lambda _: None, None)
      return out

    return checked

  def _record(self, diffs) -> None:
    diffs = np.asarray(diffs)
    self._diffs = diffs if self._diffs is None else np.maximum(self._diffs, diffs)

  def update(self, fn: UpdateFn, ctx: BuildContext) -> UpdateFn:
    if not self.config.check_gradients:
      return fn

    def mark_checked(params, opt_state, grads, fstate):
      params, opt_state, fstate = fn(params, opt_state, grads, fstate)
      return params, opt_state, {**fstate, self.name: {"checked": jnp.ones((), bool)}}

    return mark_checked

  def init_state(self, ctx: BuildContext) -> Any:
    return {"checked": jnp.zeros((), bool)} if self.config.check_gradients else None

  def after_first_step(self, metrics: dict[str, Any]) -> None:
    if self.config.check_gradients:
      jax.effects_barrier()
      if self._diffs is not None:
        _raise_if_different(self._diffs, self._paths)

  def describe(self) -> str:
    end = self.config.end_taskgraph
    scope = "all task graphs" if end < 0 else f"task graphs 0..{end}"
    check = ", gradients checked on the first step" if self.config.check_gradients else ""
    return f"gradient checkpointing ({self._found}; {scope}{check})"


def run_segments(program: Steps, flat_args, segments, loops=frozenset(), *,
                 platform: str, offload: bool = False) -> Any:
  """Evaluates ``program``, each rematerialized segment as one recomputed unit and each loop
  in ``loops`` (step indices) with its body rematerialized per iteration.

  Which mechanism runs where:
  - scanned layers, every platform: ``jax.checkpoint`` of the scan body. The backward loop
    recomputes one iteration at a time from the carries the forward loop stacked; no backend
    can merge that back into the forward loop, so it saves memory on XLA:CPU too.
  - unrolled segments, every platform: ``recompute.rematerialize`` (a custom VJP whose
    recomputation waits for the cotangents). ``jax.checkpoint`` there is undone on XLA:CPU
    (its optimization barriers are expanded, then CSE merges the recomputation into the
    forward pass), and on GPU/TPU it may recompute every block at the start of the backward
    pass; the custom VJP avoids both.
  - ``offload``: ``jax.checkpoint`` over the whole function with
    ``save_and_offload_only_these_names``: the values live across segment boundaries (and the
    carries of scanned layers) are named and copied to host memory, the rest recomputed.
  """
  rule = _loop_rule(loops, offload)

  def run(flat):
    env = start_env(program, flat)
    for seg in segments:
      steps = program.steps[seg.start:seg.stop]
      if not seg.remat:
        run_steps(steps, env, rule)
        continue
      inputs, outputs = live_across(program, steps)
      if offload:     # what a later segment reads is copied to the host, the rest recomputed
        run_steps(steps, env, rule)
        env.update({k: _name(env[k]) for k in outputs})
        continue
      if not outputs:
        continue   # dead code: nothing later reads it

      def segment(*vals, steps=steps, inputs=inputs, outputs=outputs):
        local = dict(zip(inputs, vals))
        run_steps(steps, local)
        return [local[k] for k in outputs]

      values = rematerialize(segment, platform=platform)(*[env[k] for k in inputs])
      env.update(zip(outputs, values))
    return finish(program, env)

  return jax.checkpoint(run, policy=OFFLOAD)(list(flat_args)) if offload else run(flat_args)


def auto_segments(program: Steps):
  """``gradient_checkpoint.type="auto"``'s segments of ``program`` with every task graph kept
  (``GradientCheckpoint._segments`` with ``end_taskgraph`` -1): (segments, loops)."""
  loops = frozenset(blocks.scan_bodies(program))
  ranges = blocks.structural_cuts(program).ranges
  return blocks.plan_segments(program, ranges, [True] * len(program.steps)), loops


def checkpointed_residuals(closed_jaxpr, residual_bytes, platform: str = "cpu") -> int:
  """The footprint of ``gradient_checkpoint.type="auto"`` on a traced loss (``closed_jaxpr``),
  made by the code that runs it (``auto_segments``, ``run_segments``): the residual bytes
  (whole batch) the backward pass holds, ``residual_bytes`` (the estimate's reading of a
  vjp's jaxpr, ``estimate.residual_bytes``) of the loss run segment by segment (the segments'
  inputs and the plain steps' residuals), plus the largest rematerialized segment's own,
  held while it is recomputed. (A rematerialized scan body's one iteration is not added: the
  stacked carries dominate a loop of layers.)"""
  fn = jcore.jaxpr_as_fun(closed_jaxpr)
  avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed_jaxpr.jaxpr.invars]
  program, _ = trace_steps(lambda flat: fn(*flat), avals, ())
  segments, loops = auto_segments(program)
  remat = [seg for seg in segments if seg.remat]
  if not remat and not loops:
    return residual_bytes(closed_jaxpr)
  kept = residual_bytes(jax.make_jaxpr(lambda *flat: run_segments(
      program, list(flat), segments, loops, platform=platform))(*avals))
  inputs: dict[int, list] = {}

  def plain(*flat):   # (each segment's input avals)
    env = start_env(program, flat)
    for seg in segments:
      steps = program.steps[seg.start:seg.stop]
      if seg.remat:
        keys = live_across(program, steps)[0]
        inputs[seg.start] = [jax.ShapeDtypeStruct(env[k].shape, env[k].dtype) for k in keys]
      run_steps(steps, env)
    return finish(program, env)

  jax.make_jaxpr(plain)(*avals)
  largest = 0
  for seg in remat:
    steps = program.steps[seg.start:seg.stop]
    keys, outputs = live_across(program, steps)

    def segment(*vals, steps=steps, keys=keys, outputs=outputs):
      local = dict(zip(keys, vals))
      run_steps(steps, local)
      return [local[k] for k in outputs]

    largest = max(largest, residual_bytes(jax.make_jaxpr(segment)(*inputs[seg.start])))
  return kept + largest


OFFLOADED = "epl.offloaded"
OFFLOAD = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=(), names_which_can_be_offloaded=(OFFLOADED,),
    offload_src="device", offload_dst="pinned_host")


def _loop_rule(loops, offload: bool):
  """A ``run_steps`` rule running each loop in ``loops`` with its body checkpointed (the
  carries named for offloading with ``offload``)."""
  def rule(step, invals):
    if step.index not in loops:
      return bind(step, invals)
    body = scan_body(step)
    if offload:
      body = lambda consts, carry, x, body=body: body(  # noqa: E731
          consts, [_name(c) for c in carry], x)
    body = jax.checkpoint(body, prevent_cse=False, policy=OFFLOAD if offload else
                          jax.checkpoint_policies.nothing_saveable)
    return in_context(step, run_scan, step, invals, body)
  return rule


def _name(x):
  if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.inexact):
    return x
  return checkpoint_name(x, OFFLOADED)


def _mib(n: int) -> str:
  return f"{n / 2**20:.2f} MiB"


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


_CHECK_WITH_STAGES = """\
gradient_checkpoint.check_gradients compares the first step's gradients with and without
checkpointing, but this model runs as {s} pipeline stages, whose forward functions are traced
once, with checkpointing, when the plan is made: there is no reference to compare with. Check
the same model without pipeline stages (the check does not depend on how the model is
parallelized), or set gradient_checkpoint.check_gradients=False."""
