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
one stacks), made by the caller outside the stage's derivative (in the pipeline's forward of
each tick, each stack one slice of the parameter buffer, ``packing.Layout.unpack_stacked``).
The stage is differentiated a layer at a time (``vjp``, at the end of this file): its backward
reads each layer's weights from the parameter buffer again rather than stash them, and adds
each layer's gradient into its rows of the accumulator as it makes it, so a micro batch keeps
no more than the written-out layers kept and the backward holds no stack. A block that
reads a value made inside the stage per block (a weight cast or reshaped before its layer)
would have to be stacked inside the forward, a copy kept per in-flight micro batch: such a
stage stays unrolled, and ``Rolled.why_not`` says why (the plan prints it). On by default
(``pipeline.roll_layers``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from epljax.sharding.program import (MATMULS, Steps, any_eqn, in_context, live_across, read,
                                     run_steps, scan_body, scan_counts, start_env, steps_of,
                                     top_level)


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


# -- a rolled stage's derivative, a layer at a time ------------------------------------------
# jax's derivative of a scan writes every layer's weight gradient into a stacked buffer of its
# own, and reads the layers' weights as whole stacks (rebuilt from the pieces the parameter
# buffer holds them in): beside the accumulator they are added into, that is two stacks more
# than a stage whose layers are written out, where each layer's gradient fuses into the sum.
# ``vjp`` instead differentiates the stage as the steps before its rolled scan, the scan, and
# the steps after, and keeps one layer's pullback per iteration (stacked like the scan's own
# residuals); ``LayeredPull.backward`` runs those pullbacks in a reverse scan that reads each
# layer's weights and adds each layer's gradient where the caller says (one row of the
# accumulator, in place), so neither stack exists.

@dataclasses.dataclass(frozen=True, eq=False)
class _Layered:
  """The static half of a ``LayeredPull``: the program around the rolled scan, and where each
  leaf of one layer's pullback comes from (``("const", i)`` the scan's ``i``-th constant,
  ``("x", i)`` its ``i``-th stacked input's row, ``("res", j)`` the ``j``-th per-layer residual,
  ``("static", v)``)."""
  program: Steps
  scan: int                       # its index in ``program.steps``
  live: tuple[Any, ...]           # keys the steps before the scan make and later ones read
  stacks: tuple[int, ...]         # per stacked input of the scan: which stack it is
  flat: tuple[int, ...]           # the stacks' flat inputs
  in_tree: Any
  layer: list                     # [treedef, kinds] of one layer's pullback, set by tracing


@jax.tree_util.register_pytree_node_class
class LayeredPull:
  """The pullback ``vjp`` returns for a program with a rolled scan (see above). Its leaves
  are the residuals, as a ``jax.vjp`` pullback's are: the stage stashes them per micro
  batch and rebuilds it at backward time."""

  def __init__(self, rule: _Layered, pre, consts, res, post):
    self.rule, self.pre, self.consts, self.res, self.post = rule, pre, consts, res, post

  @property
  def inputs(self) -> tuple[int, ...]:
    """The flat inputs differentiated a layer at a time (``vjp``'s ``stacks``)."""
    return self.rule.flat

  def tree_flatten(self):
    return (self.pre, self.consts, self.res, self.post), self.rule

  @classmethod
  def tree_unflatten(cls, rule, children):
    return cls(rule, *children)

  def backward(self, ct: Any, row: Callable[[int, jax.Array], Any],
               add: Callable[[Any, int, jax.Array, Any], Any], acc: Any) -> tuple[Any, Any]:
    """``ct`` (the outputs' cotangent) -> (the inputs' cotangents, with ``None`` for the
    stacked inputs; ``acc`` with every layer's gradient added). ``row(i, l)``: row ``l`` of
    the scan's ``i``-th stacked input; ``add(acc, i, l, g)``: ``acc`` with ``g`` (that row's
    gradient) added."""
    rule = self.rule
    step = rule.program.steps[rule.scan]
    nc, nk = scan_counts(step.eqn)
    g_in, g_live, g_carry = self.post(jax.tree.leaves(ct))
    layer_tree, kinds = rule.layer
    inexact = [_inexact(c) for c in self.consts]

    def layer(c, xs):
      g_k, g_c, acc = c
      l, res = xs
      leaves = [value if kind == "static" else
                self.consts[value] if kind == "const" else
                row(rule.stacks[value], l) if kind == "x" else res[value]
                for kind, value in kinds]
      g_consts, g_k, g_x = jax.tree.unflatten(layer_tree, leaves)(list(g_k))
      g_c = [a + b if keep else a for a, b, keep in zip(g_c, g_consts, inexact)]
      for i, g in enumerate(g_x):
        acc = add(acc, rule.stacks[i], l, g)
      return (g_k, g_c, acc), None

    zeros = [jnp.zeros_like(c) if keep else None for c, keep in zip(self.consts, inexact)]
    n = step.eqn.params["length"]
    (g_init, g_consts, acc), _ = lax.scan(layer, (g_carry, zeros, acc),
                                          (jnp.arange(n), self.res), reverse=True)
    # The scan's constants and initial carry are inputs or values made before it.
    where = {k: i for i, k in enumerate(rule.program.inputs)}
    live = {k: i for i, k in enumerate(rule.live)}
    g_in, g_live = list(g_in), list(g_live)
    for key, g in zip(step.inputs[:nc + nk], [*g_consts, *g_init]):
      if g is None or isinstance(key, jcore.Literal):
        continue
      if key in live:
        g_live[live[key]] = _add(g_live[live[key]], g)
      elif key in where:
        g_in[where[key]] = _add(g_in[where[key]], g)
    g_pre, = self.pre(g_live)
    g_in = [_add(a, b) for a, b in zip(g_in, g_pre)]
    for i in rule.flat:
      g_in[i] = None
    return jax.tree.unflatten(rule.in_tree, g_in), acc


def vjp(f: Callable, primals: Any, stacks: Sequence[int]) -> tuple[Any, Any, Any]:
  """``jax.vjp(f, *primals, has_aux=True)`` for a function whose program holds a rolled
  scan over the flat inputs ``stacks`` (and reads them nowhere else), with a ``LayeredPull``
  as the pullback; any other program gets ``jax.vjp``'s own."""
  flat, in_tree = jax.tree.flatten(primals)
  trees = {}

  def flat_f(*xs):
    out, aux = f(*jax.tree.unflatten(in_tree, xs))
    trees["out"], trees["aux"] = jax.tree.structure(out), jax.tree.structure(aux)
    return [*jax.tree.leaves(out), *jax.tree.leaves(aux)]

  program = steps_of(jax.make_jaxpr(flat_f)(*flat))
  at = _rolled_scan(program, {program.inputs[i]: j for j, i in enumerate(stacks)})
  if at is None:
    return jax.vjp(f, *primals, has_aux=True)
  step = program.steps[at]
  nc, nk = scan_counts(step.eqn)
  pre, post = program.steps[:at], program.steps[at + 1:]
  live = tuple(live_across(program, pre)[1])
  n_out = trees["out"].num_leaves

  def run_pre(vals):
    env = start_env(program, vals)
    run_steps(pre, env)
    return [env[k] for k in live]

  def run_post(vals, live_vals, carry):
    env = {**start_env(program, vals), **dict(zip(live, live_vals)),
           **dict(zip(step.outputs, carry))}
    run_steps(post, env)
    outs = [read(env, a) for a in program.outputs]
    return outs[:n_out], outs[n_out:]

  live_vals, pull_pre = jax.vjp(run_pre, list(flat))
  env = {**start_env(program, flat), **dict(zip(live, live_vals))}
  consts, init, xs = ([read(env, a) for a in step.inputs[lo:hi]] for lo, hi in
                      ((0, nc), (nc, nc + nk), (nc + nk, len(step.inputs))))
  body = scan_body(step)
  keys = {program.inputs[i]: j for j, i in enumerate(stacks)}
  rule = _Layered(program, at, live, tuple(keys[a] for a in step.inputs[nc + nk:]),
                  tuple(stacks), in_tree, [])

  def layer(k, x):
    k_out, pull = in_context(step, jax.vjp, lambda c, k, x: body(c, k, x), consts, k, x)
    tree, kinds, res = split_pullback(pull, {**{id(v): ("const", i) for i, v in enumerate(consts)},
                                             **{id(v): ("x", i) for i, v in enumerate(x)}})
    rule.layer[:] = [tree, kinds]
    return k_out, res

  carry, res = lax.scan(layer, init, xs, length=step.eqn.params["length"])
  outs, pull_post, aux = jax.vjp(run_post, list(flat), live_vals, carry, has_aux=True)
  pull = LayeredPull(rule, pull_pre, consts, res, pull_post)
  return (jax.tree.unflatten(trees["out"], outs), pull,
          jax.tree.unflatten(trees["aux"], aux))


def split_pullback(pull: Any, known: dict[int, tuple[str, Any]]) -> tuple[Any, tuple, list]:
  """A pullback -> (its tree; where each leaf comes from: ``known[id(leaf)]``, ``("static",
  leaf)`` for a non-array, else ``("res", j)``; the residuals ``j``, to keep)."""
  leaves, tree = jax.tree.flatten(pull)
  kinds, res = [], []
  for leaf in leaves:
    if id(leaf) in known:
      kinds.append(known[id(leaf)])
    elif not hasattr(leaf, "shape"):
      kinds.append(("static", leaf))
    else:
      kinds.append(("res", len(res)))
      res.append(leaf)
  return tree, tuple(kinds), res


def _rolled_scan(program: Steps, stacks: dict) -> int | None:
  """The step of ``program``'s rolled scan: the one step reading the ``stacks`` keys, a
  forward scan over exactly them of inexact carries with no per-iteration outputs; or
  ``None``."""
  reads = lambda atoms: [a for a in atoms if not isinstance(a, jcore.Literal) and a in stacks]  # noqa: E731
  readers = [i for i, s in enumerate(program.steps) if reads(s.inputs)]
  if len(readers) != 1 or reads(program.outputs):
    return None
  step = program.steps[readers[0]]
  if step.primitive != "scan" or step.eqn.params["reverse"]:
    return None
  nc, nk = scan_counts(step.eqn)
  xs = step.inputs[nc + nk:]
  if (len(reads(xs)) != len(xs) or len(set(xs)) != len(stacks) or len(step.outputs) != nk
      or reads(step.inputs[:nc + nk])
      or not all(_inexact(v.aval) for v in step.eqn.outvars)):
    return None
  return readers[0]


def _inexact(x: Any) -> bool:
  return jnp.issubdtype(x.dtype, jnp.inexact)


def _add(a: Any, b: Any) -> Any:
  """Cotangents summed (``float0`` ones, of integer values, are zero)."""
  if b is None or getattr(b, "dtype", None) == jax.dtypes.float0:
    return a
  if a is None or getattr(a, "dtype", None) == jax.dtypes.float0:
    return b
  return a + b
