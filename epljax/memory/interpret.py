"""Re-run a traced forward function step by step, so a memory feature can act at chosen points.

The forward hook of a feature receives any ``fn(params, *args)`` (the whole loss, or one
pipeline stage). A memory feature changes *how* it runs, never *what* it computes: where a
parameter is cast, moved or gathered (at its uses), which values are kept for the backward
pass (block boundaries of rematerialization). So each such feature traces ``fn`` to a jaxpr
(``trace``) and evaluates the steps itself (``run_steps``, ``bind``), changing how some of
them are bound.

Bodies of ``jit`` calls without explicit shardings are inlined, so a jitted model is seen
equation by equation; every other higher-order primitive (scan, cond, custom_jvp, a user's own
remat) is one opaque step. A re-bound equation keeps its name stack and context (compute_on,
mesh), so the program reads as before in the HLO, and strategy frames stay visible.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jcore
from jax.extend import source_info_util

Key = tuple[int, Any]      # (scope id, jaxpr Var): a value of the flattened program


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
  """One equation of the flattened program, its inputs and outputs as program-wide keys."""
  index: int
  eqn: Any                                   # jax.extend.core.JaxprEqn
  inputs: tuple[Any, ...]                    # Key, or a jcore.Literal
  outputs: tuple[Key | None, ...]            # None for a dropped output
  name_stack: Any                            # source_info_util.NameStack, relative to fn

  @property
  def primitive(self) -> str:
    return self.eqn.primitive.name

  @property
  def frames(self) -> tuple[str, ...]:
    return tuple(getattr(s, "name", str(s)) for s in self.name_stack.stack)

  def in_aval(self, i: int):
    return self.eqn.invars[i].aval


@dataclasses.dataclass(frozen=True)
class Program:
  """``fn(params, *args)`` traced and flattened: steps in trace order over flat inputs."""
  steps: tuple[Step, ...]
  inputs: tuple[Key, ...]                    # flat leaves of (params, args)
  consts: tuple[tuple[Key, Any], ...]
  outputs: tuple[Any, ...]                   # Key or Literal per flat output
  out_avals: tuple[Any, ...]
  num_params: int
  in_tree: Any
  out_tree: Any

  @property
  def param_keys(self) -> tuple[Key, ...]:
    return self.inputs[:self.num_params]


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


def program_of(closed, num_params: int = 0, in_tree=None, out_tree=None) -> Program:
  """The flattened program of a (closed) jaxpr, e.g. the body of a loop; its inputs and
  outputs are flat lists unless trees are given."""
  jaxpr = closed.jaxpr if isinstance(closed, jcore.ClosedJaxpr) else closed
  consts_vals = closed.consts if isinstance(closed, jcore.ClosedJaxpr) else ()
  steps: list[Step] = []
  top = 0
  consts = tuple(((top, v), c) for v, c in zip(jaxpr.constvars, consts_vals))
  inputs = tuple((top, v) for v in jaxpr.invars)
  alias: dict[Key, Any] = {}
  inner_consts: list[tuple[Key, Any]] = []
  outputs = _flatten(jaxpr, top, source_info_util.new_name_stack(), steps, alias,
                     inner_consts, [top])
  out_tree = out_tree or jax.tree.structure([0] * len(jaxpr.outvars))
  return Program(tuple(steps), inputs, consts + tuple(inner_consts), tuple(outputs),
                 tuple(v.aval for v in jaxpr.outvars), num_params, in_tree, out_tree)


def _in_device_memory(x) -> jax.ShapeDtypeStruct:
  """``x``'s abstract value in device memory (keeping what a shard_map knows of it)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  if manual is None or manual.empty:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=aval.sharding, manual_axis_type=manual)


def _inlinable(eqn) -> bool:
  if eqn.primitive.name not in ("jit", "pjit", "closed_call", "core_call"):
    return False
  if eqn.primitive.name in ("jit", "pjit"):
    unspecified = lambda s: type(s).__name__ == "UnspecifiedValue"  # noqa: E731
    return (all(unspecified(s) for s in eqn.params["in_shardings"])
            and all(unspecified(s) for s in eqn.params["out_shardings"]))
  return True


def _flatten(jaxpr, scope: int, prefix, steps: list[Step], alias: dict, consts: list,
             counter: list[int]):
  """Appends the steps of ``jaxpr`` (in ``scope``) and returns its outputs as keys/literals."""

  def resolve(v):
    if isinstance(v, jcore.Literal):
      return v
    key = (scope, v)
    return alias.get(key, key)

  for eqn in jaxpr.eqns:
    stack = prefix + eqn.source_info.name_stack
    if _inlinable(eqn):
      inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
      inner_jaxpr = inner.jaxpr if isinstance(inner, jcore.ClosedJaxpr) else inner
      counter[0] += 1
      child = counter[0]
      if isinstance(inner, jcore.ClosedJaxpr):
        consts.extend(((child, v), c) for v, c in zip(inner_jaxpr.constvars, inner.consts))
      for v, outer in zip(inner_jaxpr.invars, eqn.invars):
        alias[(child, v)] = resolve(outer)
      outs = _flatten(inner_jaxpr, child, stack, steps, alias, consts, counter)
      for v, out in zip(eqn.outvars, outs):
        if not isinstance(v, jcore.DropVar):
          alias[(scope, v)] = out
      continue
    steps.append(Step(
        len(steps), eqn, tuple(resolve(v) for v in eqn.invars),
        tuple(None if isinstance(v, jcore.DropVar) else (scope, v) for v in eqn.outvars),
        stack))
  return [resolve(v) for v in jaxpr.outvars]


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
  nc, nk = scan_counts(step)
  consts, carry, xs = list(invals[:nc]), list(invals[nc:nc + nk]), list(invals[nc + nk:])

  def one(c, x):
    outs = list(body(consts, list(c), list(x)))
    return outs[:nk], outs[nk:]

  extra = {"_split_transpose": p["_split_transpose"]} if "_split_transpose" in p else {}
  carry, ys = jax.lax.scan(one, carry, xs, length=p["length"], reverse=p["reverse"],
                           unroll=p["unroll"], **extra)
  return list(carry) + list(ys)


def scan_counts(step: Step) -> tuple[int, int]:
  """(number of constants, number of carries) of a ``scan`` step; the inputs are constants,
  carries, then the sliced arrays (jax 0.10 has counts, 0.11 a flat tree of the three)."""
  p = step.eqn.params
  if "num_consts" in p:
    return p["num_consts"], p["num_carry"]
  consts, carry, _ = p["ft_in"].unpack()
  return len(consts), len(carry)


def scan_body(step: Step) -> Callable:
  """The body of a ``scan`` step as ``body(consts, carry, x) -> carry + ys``."""
  fun = jcore.jaxpr_as_fun(step.eqn.params["jaxpr"])
  return lambda consts, carry, x: list(fun(*consts, *carry, *x))


def live_across(program: Program, start: int, stop: int) -> tuple[list[Key], list[Key]]:
  """Keys that steps ``[start, stop)`` read from before ``start`` (their inputs), and keys they
  define that later steps or the program's outputs read (their outputs), in order."""
  defined = {k for s in program.steps[start:stop] for k in s.outputs if k is not None}
  inputs: dict[Key, None] = {}
  for s in program.steps[start:stop]:
    for a in s.inputs:
      if not isinstance(a, jcore.Literal) and a not in defined:
        inputs.setdefault(a, None)
  later: set[Key] = {a for s in program.steps[stop:] for a in s.inputs
                     if not isinstance(a, jcore.Literal)}
  later |= {a for a in program.outputs if not isinstance(a, jcore.Literal)}
  outputs = [k for s in program.steps[start:stop] for k in s.outputs
             if k is not None and k in later]
  return list(inputs), outputs


def nbytes(aval) -> int:
  """Bytes of one value of ``aval`` (0 for tokens and other non-arrays)."""
  shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
  if shape is None or dtype is None:
    return 0
  n = 1
  for d in shape:
    n *= int(d)
  return n * dtype.itemsize

