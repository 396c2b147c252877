"""Re-run a traced forward function step by step, so a memory feature can act at chosen points.

A memory feature changes *how* ``fn(params, *args)`` (the loss, or one pipeline stage) runs,
never *what* it computes: it traces ``fn`` (``trace``: plain calls entered by the shared walker,
every other higher-order primitive one step) and evaluates the steps itself (``run_steps``,
``bind``). A re-bound equation keeps its name stack and context (compute_on, mesh), so
strategy frames stay visible and the HLO reads as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jcore
from jax.extend import source_info_util

from epljax.sharding.program import Key, Step, live_across, nbytes, scan_counts  # noqa: F401
from epljax.sharding.program import Steps as Program
from epljax.sharding.program import steps_of as program_of

def trace(fn: Callable, params: Any, args: Sequence[Any], *,
          in_device_memory: bool = False) -> tuple[Program, list[Any]]:
  """Traces ``fn(params, *args)`` on the avals of its arguments; returns the program and the
  flat argument values to run it on.

  With ``in_device_memory`` the parameters are traced as device values whatever memory they
  are in (the caller moves them before their use): model code cannot mix memories in one op.
  """
  leaves, in_tree = jax.tree.flatten((params, tuple(args)))
  num_params = len(jax.tree.leaves(params))
  traced = list(leaves)
  if in_device_memory:
    traced[:num_params] = [_in_device_memory(x) for x in leaves[:num_params]]

  def flat_fn(*flat):
    p, a = jax.tree.unflatten(in_tree, flat)
    return fn(p, *a)

  closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*traced)
  return program_of(closed, num_params, in_tree, jax.tree.structure(out_shape)), leaves


def _in_device_memory(x) -> jax.ShapeDtypeStruct:
  """``x``'s abstract value in device memory (keeping what a shard_map knows of it)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  if manual is None or manual.empty:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=aval.sharding, manual_axis_type=manual)


# -- evaluation ----------------------------------------------------------------------------

def bind(step: Step, invals: Sequence[Any], **param_changes) -> list[Any]:
  """Binds ``step``'s primitive on ``invals`` under its own name stack and context."""
  return in_context(step, bind_here, step, invals, **param_changes)


def bind_here(step: Step, invals: Sequence[Any], **param_changes) -> list[Any]:
  """Binds ``step``'s primitive in the current context (inside ``in_context(step, ...)``)."""
  eqn = step.eqn
  params = dict(eqn.params, **param_changes) if param_changes else eqn.params
  out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
  return list(out) if eqn.primitive.multiple_results else [out]


def in_context(step: Step, fn: Callable, *args, **kwargs):
  """Calls ``fn(*args)`` as if it were part of ``step``: same name stack and context, so what
  a feature inserts around an equation (a cast, a transfer) belongs to the same block."""
  stack = source_info_util.current_name_stack() + step.name_stack
  with source_info_util.user_context(step.eqn.source_info.traceback, name_stack=stack), \
      step.eqn.ctx.manager:
    return fn(*args, **kwargs)


Rule = Callable[[Step, list], list]   # (step, input values) -> output values


def read(env: dict, a: Any) -> Any:
  return a.val if isinstance(a, jcore.Literal) else env[a]


def run_steps(steps: Sequence[Step], env: dict, rule: Rule = None) -> None:
  """Evaluates ``steps`` in order, reading and writing ``env`` (key -> value)."""
  rule = rule or (lambda step, invals: bind(step, invals))
  for step in steps:
    outs = rule(step, [read(env, a) for a in step.inputs])
    for key, val in zip(step.outputs, outs):
      if key is not None:
        env[key] = val


def start_env(program: Program, flat_args: Sequence[Any]) -> dict:
  env = dict(program.consts)
  env.update(zip(program.inputs, flat_args))
  return env


def finish(program: Program, env: dict, cast_back: bool = False) -> Any:
  """The outputs of ``fn`` from ``env``, unflattened (cast to the traced dtypes if asked)."""
  outs = [read(env, a) for a in program.outputs]
  if cast_back:
    outs = [_cast_to(o, aval) for o, aval in zip(outs, program.out_avals)]
  return jax.tree.unflatten(program.out_tree, outs)


def _cast_to(x, aval):
  dtype = getattr(aval, "dtype", None)
  if dtype is None or not hasattr(x, "dtype") or x.dtype == dtype:
    return x
  return jax.lax.convert_element_type(x, dtype)


def run_scan(step: Step, invals: Sequence[Any], body: Callable) -> list[Any]:
  """Re-binds a ``scan`` step through ``jax.lax.scan`` with ``body(consts, carry, x) ->
  carry + ys`` (lists), so a feature can change how each iteration runs (rematerialize it,
  cast or gather its weights). Call inside ``in_context(step, ...)``."""
  p = step.eqn.params
  nc, nk = scan_counts(step.eqn)
  consts, carry, xs = list(invals[:nc]), list(invals[nc:nc + nk]), list(invals[nc + nk:])

  def one(c, x):
    outs = list(body(consts, list(c), list(x)))
    return outs[:nk], outs[nk:]

  extra = {"_split_transpose": p["_split_transpose"]} if "_split_transpose" in p else {}
  carry, ys = jax.lax.scan(one, carry, xs, length=p["length"], reverse=p["reverse"],
                           unroll=p["unroll"], **extra)
  return list(carry) + list(ys)


def scan_body(step: Step) -> Callable:
  """The body of a ``scan`` step as ``body(consts, carry, x) -> carry + ys``."""
  fun = jcore.jaxpr_as_fun(step.eqn.params["jaxpr"])
  return lambda consts, carry, x: list(fun(*consts, *carry, *x))
