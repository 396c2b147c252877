"""Residuals that are functions of a stage's parameters alone (a weight's low-precision cast,
a reshaped kernel): the backward recomputes them from the parameters instead of the stash
keeping one copy per micro batch in flight.

Which residuals qualify is read from the stage's traced forward: a value is *varying* when
it depends on an incoming activation, a batch leaf or the model state, or comes from an
equation with effects; everything else is a function of the parameters (and constants) and
gives the same bits whenever it is recomputed. Calls (``jit``, ``remat``, custom
derivatives) are followed into, and so is ``scan`` (a rolled stage's layers: what each layer
computes from its own weights, ``xs``, alone is a function of the parameters); any other
equation with a body (``while``, ``cond``) is varying as a whole when any input is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax.extend import core as jcore
from jax.interpreters import partial_eval as pe

from epljax.sharding.program import CALLS, DERIVATIVE_CALLS, scan_counts

# Equations whose body maps its inputs to its outputs one to one, run once.
_CALLS = CALLS | DERIVATIVE_CALLS


@dataclasses.dataclass(frozen=True, eq=False)
class Derived:
  """The program ``params -> residuals`` the backward replays: the stage's forward cut down
  to the outputs it keeps (``pe.dce_jaxpr``), fed the parameter leaves ``inputs``."""
  program: jcore.ClosedJaxpr
  inputs: tuple[int, ...]

  def __call__(self, params: Sequence[Any]) -> list[Any]:
    return jcore.jaxpr_as_fun(self.program)(*(params[i] for i in self.inputs))


def _body(eqn) -> jcore.Jaxpr | None:
  if eqn.primitive.name not in _CALLS:
    return None
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    body = eqn.params.get(key)
    body = getattr(body, "jaxpr", body)
    if (isinstance(body, jcore.Jaxpr) and len(body.invars) == len(eqn.invars)
        and len(body.outvars) == len(eqn.outvars)):
      return body
  return None


def _varying_outputs(jaxpr: jcore.Jaxpr, varying_in: Sequence[bool]) -> list[bool]:
  varying = {v for v, b in zip(jaxpr.invars, varying_in) if b}
  is_varying = lambda v: isinstance(v, jcore.Var) and v in varying  # noqa: E731
  for eqn in jaxpr.eqns:
    ins = [is_varying(v) for v in eqn.invars]
    body = _body(eqn)
    if eqn.effects:
      outs = [True] * len(eqn.outvars)
    elif body is not None:
      outs = _varying_outputs(body, ins)
    elif eqn.primitive.name == "scan":
      outs = _scan_outputs(eqn, ins)
    else:
      outs = [any(ins)] * len(eqn.outvars)
    varying.update(v for v, b in zip(eqn.outvars, outs) if b)
  return [is_varying(v) for v in jaxpr.outvars]


def _scan_outputs(eqn, ins: list[bool]) -> list[bool]:
  """A scan's outputs (carry, then ys): a carry is varying from the first iteration in which
  what it is fed is (a fixed point over the body)."""
  body = eqn.params["jaxpr"].jaxpr
  n_consts, n_carry = scan_counts(eqn)
  if len(body.invars) != len(ins) or len(body.outvars) != len(eqn.outvars):
    return [any(ins)] * len(eqn.outvars)
  carry = ins[n_consts:n_consts + n_carry]
  while True:
    outs = _varying_outputs(body, [*ins[:n_consts], *carry, *ins[n_consts + n_carry:]])
    grown = [a or b for a, b in zip(carry, outs[:n_carry])]
    if grown == carry:
      return outs
    carry = grown


def split(closed: jcore.ClosedJaxpr, n_params: int,
          outputs: Sequence[int]) -> tuple[list[int], Derived | None]:
  """``closed``: a stage's forward, its first ``n_params`` inputs the parameters;
  ``outputs``: the positions of its stash leaves. -> (the stash leaves that are functions of
  the parameters alone, by their index in ``outputs``; the program computing them in that
  order, or ``None`` when there are none)."""
  n_in = len(closed.jaxpr.invars)
  varying = _varying_outputs(closed.jaxpr, [i >= n_params for i in range(n_in)])
  fixed = [k for k, i in enumerate(outputs) if not varying[i]]
  if not fixed:
    return [], None
  # ``outputs`` ascend (the stash is one subtree of the forward's outputs), and dce keeps
  # the output order: the program's outputs are in the order of ``fixed``.
  keep = {outputs[k] for k in fixed}
  if sorted(outputs) != list(outputs):   # internal invariant
    raise AssertionError(f"stash outputs out of order: {outputs}")
  cut, used = pe.dce_jaxpr(closed.jaxpr, [i in keep for i in range(len(closed.jaxpr.outvars))])
  inputs = tuple(i for i, u in enumerate(used) if u)
  if any(i >= n_params for i in inputs):   # internal invariant: the analysis above
    raise AssertionError(f"a parameter-only residual reads inputs {inputs} "
                         f"beyond the {n_params} parameters")
  return fixed, Derived(jcore.ClosedJaxpr(cut, closed.consts), inputs)
