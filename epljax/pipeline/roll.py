"""Repeated layers of a stage as one ``lax.scan``: a stage's program that does not grow with depth.

A stage cut from a model whose layers are written out (a Python loop of Flax modules) holds
its layers one after the other: 12 copies of a block's equations, forward and backward, each
compiled on its own. ``roll_repeats`` finds the longest run of equal blocks in a stage's
program and writes it as a ``lax.scan`` over the blocks' parameters stacked along a new leading
axis, so the compiled stage holds one block, as a hand-written pipeline over stacked layers
does. The arithmetic is the same, in the same order.

Blocks are found by structure, never by names: a run of ``n >= 2`` equal stretches of ``p``
equations (same primitives, parameters, shapes and literals) is rolled when its dataflow is a
loop's: every value a block reads is made inside the block, made by the block just before it
(the carry), the same value for every block (a mask, a constant), or one parameter per block
(stacked). A value made by a block and read two blocks later, or read after the run from any
block but the last, leaves the stage unrolled. Only runs that contain a matmul or a
convolution are rolled (a layer), and none with side effects.

The stacks are inputs of the rolled program (``Rolled.stacks`` says which parameters each
one stacks), made by the caller outside the stage's ``jax.vjp`` (in the pipeline's forward and
backward of each tick, each stack one slice of the parameter buffer,
``packing.Layout.unpack_stacked``): the scan's pullback then refers to the
stacked input itself, which the pipeline makes again at backward time rather than stash, and
a micro batch keeps no more than the written-out layers kept. A block that
reads a value made inside the stage per block (a weight cast or reshaped before its layer)
would have to be stacked inside the forward, a copy kept per in-flight micro batch: such a
stage stays unrolled, and ``Rolled.why_not`` says why (the plan prints it). On by default
(``pipeline.roll_layers``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from epljax.sharding.program import (MATMULS, Steps, any_eqn, read, run_steps, start_env,
                                     steps_of, top_level)


@dataclasses.dataclass(frozen=True)
class Run:
  """``repeats`` blocks of ``length`` equations, starting at equation ``start``."""
  start: int
  length: int
  repeats: int


# How each operand of the block's template equation is found, in every block:
# ("lit", Literal) | ("own", (j, i)) output i of equation j of the same block |
# ("carry", slot) | ("same", Key) one outer value for every block | ("xs", index) stacked.
_Source = tuple[str, Any]


@dataclasses.dataclass
class _Loop:
  run: Run
  sources: list[list[_Source]]           # per template equation, per operand
  carry: list[tuple[int, int]]           # slots: (j, i) of the value the previous block made
  carry_init: list[Any]                  # per slot: the outer key block 0 reads, or None
  xs: list[tuple[Any, ...]]              # per stacked input: its outer key in each block
  results: dict[Any, int]                # outer use of the last block's value -> carry slot


@dataclasses.dataclass(frozen=True)
class Rolled:
  """A stage's program with its repeated layers as one scan (see the module doc).

  ``jaxpr`` takes the original inputs with one stacked input per entry of ``stacks`` inserted
  after the first ``num_params`` (the parameters); ``stacks[j]``: the parameter input each
  block reads as the ``j``-th stack's row. ``run``: the rolled run (``None``: ``jaxpr`` is the
  original); ``why_not``: why a loop-shaped run was left unrolled ("" when none was)."""
  jaxpr: jcore.ClosedJaxpr
  run: Run | None = None
  stacks: tuple[tuple[int, ...], ...] = ()
  why_not: str = ""


def roll_repeats(closed: jcore.ClosedJaxpr, num_params: int) -> Rolled:
  """``closed`` with its longest loop-shaped run of equal blocks as a ``lax.scan`` over stacks
  of its first ``num_params`` inputs, or unchanged when there is none."""
  program = steps_of(closed, enter=top_level)
  params = {k: i for i, k in enumerate(program.inputs[:num_params])}
  sigs = _signatures([step.eqn for step in program.steps])
  why_not = ""
  for run in _candidates(sigs):
    if not any(any_eqn(step.eqn, lambda q: q.primitive.name in MATMULS)
               for step in program.steps[run.start:run.start + run.length]):
      continue
    loop = _as_loop(program, run)
    if loop is None:
      continue
    made = [k for ks in loop.xs for k in ks if k not in params]
    if made:   # stacked inside the forward: a copy per in-flight micro batch
      why_not = why_not or _MADE_INSIDE.format(n=run.repeats, p=run.length, aval=_aval(made[0]))
      continue
    stacks = tuple(tuple(params[k] for k in ks) for ks in loop.xs)
    return Rolled(_rolled(closed, program, loop, num_params), run, stacks)
  return Rolled(closed, why_not=why_not)


_MATMULS_PER_BLOCK = 8   # equal matmuls a block may hold (its period is among their distances)


def layer_run(eqns: Sequence[jcore.JaxprEqn]) -> Run | None:
  """The model's repeated layers in ``eqns``: the run of equal blocks (as ``roll_repeats``
  compares them) that repeats the most equations and whose block holds a matmul or a
  convolution, or ``None``. Its candidate periods are the distances from a matmul to the next
  few equal ones (a block may hold several of one shape); per period one pass finds where the
  equations equal those a period later."""
  sigs = _signatures(eqns)
  heavy = [i for i, e in enumerate(eqns) if any_eqn(e, lambda q: q.primitive.name in MATMULS)]
  seen: dict[int, list[int]] = {}
  periods = set()
  for i in heavy:
    earlier = seen.setdefault(sigs[i], [])
    periods.update(i - j for j in earlier[-_MATMULS_PER_BLOCK:])
    earlier.append(i)
  best: Run | None = None
  for p in sorted(periods):
    i = 0
    while i + p < len(sigs):
      if sigs[i] != sigs[i + p]:
        i += 1
        continue
      start = i
      while i + p < len(sigs) and sigs[i] == sigs[i + p]:
        i += 1
      run = Run(start, p, (i - start) // p + 1)
      saved = run.length * (run.repeats - 1)
      if (run.repeats >= 2 and (best is None or saved > best.length * (best.repeats - 1))
          and any(start <= j < start + p for j in heavy)):
        best = run
  return best


_MADE_INSIDE = ("{n} x {p} ops left unrolled: each block reads a {aval} made inside the stage "
                "(a weight cast or reshaped before its layer), whose stack would be kept per "
                "in-flight micro batch")


def _signatures(eqns: Sequence[jcore.JaxprEqn]) -> list[int]:
  """Equal integers for equations that compute the same thing on values of the same types."""
  ids: dict[tuple, int] = {}
  out = []
  for eqn in eqns:
    ins = tuple(("lit", repr(a.val), str(a.aval)) if isinstance(a, jcore.Literal) else str(a.aval)
                for a in eqn.invars)
    key = (eqn.primitive.name, _params_key(eqn.params), ins,
           tuple(str(v.aval) for v in eqn.outvars), bool(eqn.effects))
    out.append(ids.setdefault(key, len(ids)))
  return out


def _params_key(params: dict) -> tuple:
  # Sub-programs print canonically (their variables are named locally); rule functions of
  # custom derivatives are new objects per call, so they are compared by type, their primal
  # programs by text.
  return tuple((k, repr(v) if not callable(v) or isinstance(v, jcore.ClosedJaxpr) else
                type(v).__name__) for k, v in sorted(params.items()))


def _candidates(sigs: Sequence[int]) -> list[Run]:
  """Every maximal run of ``>= 2`` equal stretches, the most equations saved first."""
  at: dict[int, list[int]] = {}
  for i, s in enumerate(sigs):
    at.setdefault(s, []).append(i)
  runs = set()
  n_eqns = len(sigs)
  for a, s in enumerate(sigs):
    for b in at[s]:
      p = b - a
      if p <= 0 or a + 2 * p > n_eqns:
        continue
      n = 1
      while a + (n + 1) * p <= n_eqns and sigs[a + n * p:a + (n + 1) * p] == sigs[a:a + p]:
        n += 1
      if n >= 2:
        runs.add(Run(a, p, n))
  return sorted(runs, key=lambda r: (-r.length * (r.repeats - 1), r.start, r.length))


def _as_loop(program: Steps, run: Run) -> _Loop | None:
  """The loop ``run`` is, or ``None`` when its dataflow is not a loop's."""
  a, p, n = run.start, run.length, run.repeats
  steps = program.steps
  made: dict[Any, tuple[int, int, int]] = {}     # key -> (block, j, i)
  for k in range(n):
    for j in range(p):
      step = steps[a + k * p + j]
      if step.eqn.effects:
        return None
      made.update((o, (k, j, i)) for i, o in enumerate(step.outputs) if o is not None)
  carry: list[tuple[int, int]] = []
  carry_init: list[Any] = []
  xs: list[tuple[Any, ...]] = []
  sources: list[list[_Source]] = []
  for j in range(p):
    row = []
    for o in range(len(steps[a + j].inputs)):
      atoms = [steps[a + k * p + j].inputs[o] for k in range(n)]
      source = _source(atoms, made, carry, carry_init, xs)
      if source is None:
        return None
      row.append(source)
    sources.append(row)
  # Values of the run read after it (or returned) must be the last block's carried values.
  results: dict[Any, int] = {}
  later = [x for step in steps[a + n * p:] for x in step.inputs] + list(program.outputs)
  for v in later:
    if isinstance(v, jcore.Literal) or v not in made:
      continue
    k, j, i = made[v]
    if k != n - 1:
      return None
    if (j, i) not in carry:
      carry.append((j, i))
      carry_init.append(None)   # made before it is read in every block: starts as zeros
    results[v] = carry.index((j, i))
  for slot, init in zip(carry, carry_init):
    out = steps[a + slot[0]].eqn.outvars[slot[1]].aval
    if init is not None and (_aval(init).shape, _aval(init).dtype) != (out.shape, out.dtype):
      return None
  return _Loop(run, sources, carry, carry_init, xs, results)


def _source(atoms, made, carry, carry_init, xs) -> _Source | None:
  first = atoms[0]
  if isinstance(first, jcore.Literal):
    return ("lit", first) if all(isinstance(x, jcore.Literal) for x in atoms) else None
  where = [made.get(x) for x in atoms]
  if all(w is not None and w[0] == k for k, w in enumerate(where)):       # made in its block
    own = {w[1:] for w in where}
    return ("own", own.pop()) if len(own) == 1 else None
  if where[0] is None and all(w is not None and w[0] == k - 1            # the previous block's
                              for k, w in enumerate(where) if k):
    slots = {w[1:] for w in where[1:]}
    if len(slots) != 1:
      return None
    slot = slots.pop()
    if slot in carry:
      if carry_init[carry.index(slot)] != first:
        return None
    else:
      carry.append(slot)
      carry_init.append(first)
    return ("carry", carry.index(slot))
  if any(w is not None for w in where):
    return None
  if all(x == first for x in atoms):
    return ("same", first)
  if any((_aval(x).shape, _aval(x).dtype) != (_aval(first).shape, _aval(first).dtype)
         for x in atoms):
    return None
  key = tuple(atoms)
  if key not in xs:
    xs.append(key)
  return ("xs", xs.index(key))


def _rolled(closed: jcore.ClosedJaxpr, program: Steps, loop: _Loop,
            num_params: int) -> jcore.ClosedJaxpr:
  a, p, n = loop.run.start, loop.run.length, loop.run.repeats
  # The first block's steps, each operand read from where every block finds it (``_Source``):
  # the block's own values keep their keys, the others are named by their source (a literal
  # or a value the same for every block stands for itself).
  own = {(j, i): k for j, step in enumerate(program.steps[a:a + p])
         for i, k in enumerate(step.outputs)}
  where = {"own": own.__getitem__, "carry": lambda s: ("carry", s), "xs": lambda s: ("xs", s)}
  template = [dataclasses.replace(step, inputs=tuple(where.get(kind, lambda s: s)(s)
                                                     for kind, s in sources))
              for step, sources in zip(program.steps[a:a + p], loop.sources)]
  k = len(loop.xs)

  def fn(*args):
    stacked = list(args[num_params:num_params + k])
    env = start_env(program, args[:num_params] + args[num_params + k:])
    run_steps(program.steps[:a], env)

    def block(carried, xs):
      inner = {**env, **{("carry", s): c for s, c in enumerate(carried)},
               **{("xs", s): x for s, x in enumerate(xs)}}
      run_steps(template, inner)
      return [inner[own[slot]] for slot in loop.carry], None

    init = []
    for (j, i), atom in zip(loop.carry, loop.carry_init):
      aval = template[j].eqn.outvars[i].aval
      init.append(jnp.zeros(aval.shape, aval.dtype) if atom is None else
                  lax.convert_element_type(env[atom], aval.dtype))
    final, _ = lax.scan(block, init, stacked, length=n)
    env.update((k, final[slot]) for k, slot in loop.results.items())
    run_steps(program.steps[a + n * p:], env)
    return [read(env, x) for x in program.outputs]

  sds = lambda aval, *lead: jax.ShapeDtypeStruct((*lead, *aval.shape), aval.dtype)  # noqa: E731
  avals = [sds(v.aval) for v in closed.jaxpr.invars]
  avals[num_params:num_params] = [sds(_aval(ks[0]), n) for ks in loop.xs]
  return jax.make_jaxpr(fn)(*avals)


def _aval(atom: Any) -> Any:
  """The aval of a step's operand: a Literal, or a key ``(scope, Var)``."""
  return atom.aval if isinstance(atom, jcore.Literal) else atom[1].aval
