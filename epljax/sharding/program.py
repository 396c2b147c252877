"""The one jaxpr walker: a traced program flattened into equations, across call boundaries.

JAX nests equations inside ``jit``, ``custom_jvp_call``, ``checkpoint``, ``scan``, ``cond`` and
``while``. Every part of epljax that reads or re-runs a traced program walks it here (``walk``),
deciding only which nested bodies to enter, and re-runs it here (``run_steps``, ``evaluate``),
deciding only how each equation runs (a *rule* per ``Step``):

- the capture (``Program``: strategy tagging, split rules, stage cutting) enters every body,
  so each innermost equation (a ``Node``) gets its full name stack and its inputs resolved to
  *base values*: program inputs, constants and the outputs of other nodes;
- the memory features and the gradient-sum rewrite (``sharding.reductions``) enter plain
  calls only (``CALLS``, ``steps_of``) and re-run every other equation as one ``Step``
  (``trace_steps``, ``run_steps``: the evaluation section at the end of this file);
- the stage cut (``pipeline.partition``) enters ``CALLS`` and ``DERIVATIVE_CALLS`` whose nodes
  span stages and never cuts inside ``LOOPS`` or branches; the rewrites of a stage's program
  (``pipeline.roll``, ``pipeline.chunks``) enter nothing (``top_level``).

Whatever it enters, a walk numbers equations as the capture does: each ``Step`` knows the
``Node`` indices it stands for (``nodes``), so a partial walk lines up with the capture's
per-node decisions. ``sub_calls`` is the one list of how a call-like equation maps its operands
and results to its bodies; ``inner_eqns`` and ``any_eqn`` look inside nested bodies without
flattening.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.extend import core as jcore
from jax.extend import source_info_util
from jax.tree_util import tree_structure

# Plain function calls: the body runs once, as written.
CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})
# Calls with a derivative rule or rematerialization around their body: inlining one
# differentiates the body instead (same gradients, up to the rule's numerical tricks).
REMAT = frozenset({"checkpoint", "remat", "remat2"})   # jax.checkpoint: "remat2" in jax 0.10/0.11
DERIVATIVE_CALLS = frozenset({"custom_jvp_call", "custom_vjp_call",
                              "custom_vjp_call_jaxpr"}) | REMAT
LOOPS = frozenset({"scan", "while"})
MATMULS = frozenset({"dot_general", "conv_general_dilated"})   # the heavy, weight-reading ops

# A Flax method other than __call__ runs in the named scope "<module>.<method>".
_METHOD = re.compile(r"(?<=[A-Za-z0-9_])\.[A-Za-z_]\w*$")

Key = tuple[int, Any]      # (scope id, jaxpr Var): one value of the flattened program
# (inner jaxpr, its constants, [(inner invar, outer var)], [(outer var, inner outvar)])
Call = tuple[Any, list, list, list]


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
  """One equation the walk did not enter, its inputs and outputs as program-wide keys."""
  index: int
  eqn: jcore.JaxprEqn
  # Per operand: a Key (``steps_of``: only plain calls entered), or the tuple of Keys it may
  # carry (``walk``: a value out of an entered ``cond`` is any branch's); or a Literal.
  inputs: tuple[Any, ...]
  outputs: tuple[Key | None, ...]          # None for a dropped output
  name_stack: Any                          # source_info_util.NameStack, from the walk's root
  nodes: range                             # the capture's nodes (every body entered) it stands for
  enclosing: tuple[jcore.JaxprEqn, ...] = ()   # the entered equations around it, outermost first

  @property
  def primitive(self) -> str:
    return self.eqn.primitive.name

  @property
  def frames(self) -> tuple[str, ...]:
    return tuple(getattr(s, "name", str(s)) for s in self.name_stack.stack)

  @property
  def module_frames(self) -> tuple[str, ...]:
    """The name-stack scopes alone (no transform entries: ``vmap``, ``jvp``), method suffixes
    dropped: the module path ``epl.annotate`` rules match."""
    return tuple(s.name if s.name.startswith("epl.") else _METHOD.sub("", s.name)
                 for s in self.name_stack.stack if type(s).__name__ == "Scope")

  def in_aval(self, i: int):
    return self.eqn.invars[i].aval


@dataclasses.dataclass(frozen=True)
class Steps:
  """A program flattened into steps, in trace order over flat inputs."""
  steps: tuple[Step, ...]
  inputs: tuple[Key, ...]                    # flat leaves of (params, args)
  consts: tuple[tuple[Key, Any], ...]        # of the root and of every entered body
  outputs: tuple[Any, ...]                   # per flat output: as a Step's inputs
  jaxpr: Any                                 # what was flattened (a closed jaxpr or jaxpr)
  num_params: int = 0
  out_tree: Any = None

  @property
  def param_keys(self) -> tuple[Key, ...]:
    return self.inputs[:self.num_params]

  @property
  def out_avals(self) -> tuple[Any, ...]:
    return tuple(v.aval for v in _body(self.jaxpr)[0].outvars)


def walk(closed: Any, enter: Callable[[jcore.JaxprEqn, range], bool] | None = None,
         start: int = 0) -> Steps:
  """Flattens ``closed`` (a ClosedJaxpr or Jaxpr) in trace order, entering the bodies of the
  equations that ``sub_calls`` can map and ``enter(eqn, nodes)`` accepts (default: all);
  ``nodes`` are the capture's node indices the equation stands for, numbered from ``start``."""
  jaxpr, consts = _body(closed)
  steps: list[Step] = []
  alias: dict[Key, Any] = {}      # inner value -> the outer Keys (or Literal) it stands for
  all_consts = [((0, v), c) for v, c in zip(jaxpr.constvars, consts)]
  scopes = [0]
  cursor = [start]
  spans: dict[int, int] = {}

  def resolve(scope: int, v: Any):
    if isinstance(v, jcore.Literal):
      return v
    return alias.get((scope, v), ((scope, v),))

  def go(jaxpr, scope, prefix, enclosing):
    for eqn in jaxpr.eqns:
      stack = prefix + eqn.source_info.name_stack
      calls = sub_calls(eqn)
      nodes = range(cursor[0], cursor[0] + (1 if calls is None else _span(eqn, spans)))
      if calls is not None and enter is not None and not enter(eqn, nodes):
        calls = None
      if calls is None:
        steps.append(Step(
            len(steps), eqn, tuple(resolve(scope, v) for v in eqn.invars),
            tuple(None if isinstance(v, jcore.DropVar) else (scope, v) for v in eqn.outvars),
            stack, nodes, enclosing))
        cursor[0] = nodes.stop
        continue
      outer_outs: dict[Any, list] = defaultdict(list)
      for inner, inner_consts, in_map, out_map in calls:
        scopes[0] += 1
        child = scopes[0]
        all_consts.extend(((child, v), c) for v, c in zip(inner.constvars, inner_consts))
        for inner_v, outer_v in in_map:
          alias[(child, inner_v)] = resolve(scope, outer_v)
        go(inner, child, stack, enclosing + (eqn,))
        for outer_o, inner_o in out_map:
          outer_outs[outer_o].append(resolve(child, inner_o))
      for outer_o, found in outer_outs.items():
        keys = [k for r in found if not isinstance(r, jcore.Literal) for k in r]
        alias[(scope, outer_o)] = found[0] if len(found) == 1 else tuple(dict.fromkeys(keys))

  go(jaxpr, 0, source_info_util.new_name_stack(), ())
  return Steps(tuple(steps), tuple((0, v) for v in jaxpr.invars), tuple(all_consts),
               tuple(resolve(0, v) for v in jaxpr.outvars), closed)


def _span(eqn: jcore.JaxprEqn, spans: dict[int, int]) -> int:
  """How many capture nodes ``eqn`` stands for: its innermost equations, every body entered."""
  n = spans.get(id(eqn))
  if n is None:
    calls = sub_calls(eqn)
    n = 1 if calls is None else sum(_span(e, spans) for call in calls for e in call[0].eqns)
    spans[id(eqn)] = n
  return n


def bind_here(eqn: jcore.JaxprEqn, values: Any, **params: Any) -> list[Any]:
  """Binds ``eqn``'s primitive on ``values`` in the current name stack and context."""
  params = {**eqn.params, **params} if params else eqn.params
  out = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(params))
  return list(out) if eqn.primitive.multiple_results else [out]


@contextlib.contextmanager
def _context(eqn: jcore.JaxprEqn, name_stack):
  """The context ``eqn`` was traced in (compute_on, mesh), its traceback and ``name_stack``
  below the current one."""
  stack = source_info_util.current_name_stack() + name_stack
  with source_info_util.user_context(eqn.source_info.traceback, name_stack=stack), \
      eqn.ctx.manager:
    yield


def sub_calls(eqn: jcore.JaxprEqn) -> list[Call] | None:
  """How a call-like equation maps its operands and results to its bodies, or None when it is
  innermost (or a higher-order primitive whose bodies do not line up with its operands)."""
  params = eqn.params
  name = eqn.primitive.name
  outs = list(eqn.outvars)
  if name == "while":
    (cond, cond_consts), (body, body_consts) = map(_body, (params["cond_jaxpr"],
                                                          params["body_jaxpr"]))
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    ops = list(eqn.invars)
    carry = ops[nc + nb:]
    return [
        (cond, cond_consts, list(zip(cond.invars, ops[:nc] + carry)), []),
        (body, body_consts, list(zip(body.invars, ops[nc:nc + nb] + carry)),
         list(zip(outs, body.outvars))),
    ]
  if name == "cond":
    ops = list(eqn.invars[1:])
    return [(b, consts, list(zip(b.invars, ops)), list(zip(outs, b.outvars)))
            for b, consts in map(_body, params["branches"])]
  inner = [_body(v) for v in params.values() if isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr))]
  if len(inner) != 1:
    return None
  ((j, consts),) = inner
  if len(j.invars) != len(eqn.invars) or len(j.outvars) != len(outs):
    return None
  return [(j, consts, list(zip(j.invars, eqn.invars)), list(zip(outs, j.outvars)))]


def rewrite_eqns(closed: jcore.ClosedJaxpr,
                 fn: Callable[[jcore.JaxprEqn], jcore.JaxprEqn | None],
                 aval_fn: Callable[[Any], Any] | None = None) -> jcore.ClosedJaxpr:
  """``closed`` with every innermost equation, in every nested body (calls, loops, branches,
  remat), replaced by ``fn(eqn)``: an equation with the same outputs, or None to drop one whose
  outputs are its inputs (a sharding constraint). ``aval_fn`` retypes every variable (a call
  returns its body's output types as they were traced). What is left alone keeps its
  identity: without changes ``closed`` itself comes back."""
  jaxpr = _rewrite(closed.jaxpr, fn, aval_fn)
  return closed if jaxpr is closed.jaxpr else jcore.ClosedJaxpr(jaxpr, closed.consts)


def _rewrite(jaxpr: jcore.Jaxpr, fn, aval_fn) -> jcore.Jaxpr:
  subst: dict[Any, Any] = {}
  changed = False

  def sub(v):
    return v if isinstance(v, jcore.Literal) else subst.get(v, v)

  def binder(v):
    nonlocal changed
    if aval_fn is None or isinstance(v, jcore.DropVar):
      return v
    aval = aval_fn(v.aval)
    if aval is v.aval:
      return v
    changed = True
    subst[v] = jcore.Var(aval)
    return subst[v]

  constvars = [binder(v) for v in jaxpr.constvars]
  invars = [binder(v) for v in jaxpr.invars]
  eqns = []
  for eqn in jaxpr.eqns:
    traced_outs = list(eqn.outvars)
    ins = [sub(v) for v in eqn.invars]
    params = {k: _rewrite_param(v, fn, aval_fn) for k, v in eqn.params.items()}
    outs = [binder(v) for v in eqn.outvars]
    if (ins != list(eqn.invars) or outs != list(eqn.outvars)
        or any(params[k] is not v for k, v in eqn.params.items())):
      eqn = eqn.replace(invars=ins, outvars=outs, params=params)
      changed = True
    if not any(True for _ in jcore.jaxprs_in_params(eqn.params)):
      new = fn(eqn)
      if new is None:
        subst.update(zip(traced_outs, ins))
        changed = True
        continue
      changed |= new is not eqn
      eqn = new
    eqns.append(eqn)
  if not changed:
    return jaxpr
  return jaxpr.replace(constvars=constvars, invars=invars, eqns=eqns,
                       outvars=[sub(v) for v in jaxpr.outvars])


def _rewrite_param(v: Any, fn, aval_fn) -> Any:
  if isinstance(v, jcore.ClosedJaxpr):
    return rewrite_eqns(v, fn, aval_fn)
  if isinstance(v, jcore.Jaxpr):
    return _rewrite(v, fn, aval_fn)
  if isinstance(v, tuple) and any(isinstance(b, (jcore.ClosedJaxpr, jcore.Jaxpr)) for b in v):
    new = tuple(_rewrite_param(b, fn, aval_fn) for b in v)
    return v if all(a is b for a, b in zip(new, v)) else new
  return v


def eqns_in(jaxpr: jcore.Jaxpr) -> Iterator[jcore.JaxprEqn]:
  """Every equation of ``jaxpr`` and of its nested bodies, at any depth."""
  for e in jaxpr.eqns:
    yield e
    yield from inner_eqns(e)


def inner_eqns(eqn: jcore.JaxprEqn) -> Iterator[jcore.JaxprEqn]:
  """Every equation nested in ``eqn``'s bodies, at any depth."""
  for sub in jcore.jaxprs_in_params(eqn.params):
    yield from eqns_in(sub)


def any_eqn(eqn: jcore.JaxprEqn, pred: Callable[[jcore.JaxprEqn], bool]) -> bool:
  """``pred`` holds for ``eqn`` or for an equation nested in it."""
  return pred(eqn) or any(pred(e) for e in inner_eqns(eqn))


def _body(v: Any) -> tuple[jcore.Jaxpr, list]:
  return (v.jaxpr, list(v.consts)) if isinstance(v, jcore.ClosedJaxpr) else (v, [])


# -- the capture's view: innermost equations with their base values --------------------------

Base = Any  # a jcore.Var that is a program input, a constant or the output of a Node


@dataclasses.dataclass(eq=False)
class Node:
  """One innermost equation of the program."""
  index: int
  eqn: jcore.JaxprEqn
  frames: tuple[str, ...]                  # name-stack entries, outermost first
  inputs: tuple[tuple[Base, ...], ...]     # per operand: the base values it may carry
  enclosing: tuple[str, ...]               # primitives this node sits inside, outermost first
  enclosing_ids: tuple[int, ...] = ()      # and which equations those are (ids)
  module_frames: tuple[str, ...] = ()      # the name-stack scopes alone: no transform entries
                                           # (``vmap``, ``jvp``), method suffixes dropped
  trips: int = 1                           # how often it runs: the lengths of the scans around
                                           # it multiplied (a while loop's count is unknown: 1)
  remat: int = 0                           # the ``checkpoint`` that may run it again: its id,
                                           # 0 when none or its policy saves it (``_remat``)

  @property
  def primitive(self) -> str:
    return self.eqn.primitive.name

  def __repr__(self) -> str:
    return f"Node({self.index}, {self.primitive}, {'/'.join(self.frames)})"


class Program:
  """The nodes of ``closed_jaxpr`` in trace order (every body entered), with producers and
  consumers."""

  def __init__(self, closed_jaxpr: jcore.ClosedJaxpr):
    self.closed_jaxpr = closed_jaxpr
    self.invars: tuple[jcore.Var, ...] = tuple(closed_jaxpr.jaxpr.invars)
    flat = walk(closed_jaxpr)
    self.nodes: list[Node] = [_node(step) for step in flat.steps]
    self.outputs = tuple(_bases(r) for r in flat.outputs)
    self.producer: dict[Base, Node] = {}
    self.consumers: dict[Base, list[tuple[Node, int]]] = defaultdict(list)
    for node in self.nodes:
      for out in node.eqn.outvars:
        self.producer[out] = node
      for pos, bases in enumerate(node.inputs):
        for b in bases:
          self.consumers[b].append((node, pos))

  def uses_of_input(self, i: int) -> list[tuple[Node, int]]:
    """The nodes (and operand positions) that read program input ``i``."""
    return list(self.consumers.get(self.invars[i], ()))

  def node_consumers(self, node: Node) -> list[Node]:
    return [c for out in node.eqn.outvars for c, _ in self.consumers.get(out, ())]

  def node_producers(self, node: Node) -> list[Node]:
    return [self.producer[b] for bases in node.inputs for b in bases if b in self.producer]


def _bases(resolved: Any) -> tuple[Base, ...]:
  return () if isinstance(resolved, jcore.Literal) else tuple(k[1] for k in resolved)


def _node(step: Step) -> Node:
  trips = 1
  for e in step.enclosing:
    if e.primitive.name == "scan":
      trips *= int(e.params["length"])
  return Node(step.index, step.eqn, step.frames, tuple(_bases(r) for r in step.inputs),
              tuple(e.primitive.name for e in step.enclosing),
              tuple(id(e) for e in step.enclosing), step.module_frames, trips,
              _remat(step.eqn, step.enclosing))


def _remat(eqn: jcore.JaxprEqn, enclosing: Sequence[jcore.JaxprEqn]) -> int:
  """The id of the innermost ``checkpoint`` around ``eqn`` (the model's own ``nn.remat``,
  ``jax.checkpoint``) whose policy does not save its outputs, or 0: the backward pass runs
  ``eqn`` again where that body's own backward needs its outputs. A policy is asked as JAX's
  partial evaluation asks it, ``policy(primitive, *avals, **params)``: falsy or ``Recompute``
  for an output not saved."""
  for e in reversed(enclosing):
    if e.primitive.name not in REMAT:
      continue
    policy = e.params.get("policy")
    saved = policy is not None and policy(eqn.primitive, *(v.aval for v in eqn.invars),
                                          **eqn.params)
    return 0 if saved and type(saved).__name__ != "RecomputeType" else id(e)
  return 0


# -- the memory features' view: steps, plain calls entered ------------------------------------

def steps_of(closed, num_params: int = 0, out_tree=None, *,
             enter: Callable[[jcore.JaxprEqn, range], bool] | None = None,
             start: int = 0) -> Steps:
  """The flattened program of a (closed) jaxpr, e.g. the body of a loop; its inputs and
  outputs are flat lists unless ``out_tree`` is given. The equations ``enter(eqn, nodes)`` accepts
  (``walk``'s; default: plain calls, ``inlinable``) are entered, every other equation is one
  step; its capture nodes are numbered from ``start``."""
  flat = walk(closed, enter or (lambda eqn, nodes: inlinable(eqn)), start)
  steps = tuple(dataclasses.replace(s, inputs=tuple(map(_one, s.inputs))) for s in flat.steps)
  outs = tuple(map(_one, flat.outputs))
  return dataclasses.replace(flat, steps=steps, outputs=outs, num_params=num_params,
                             out_tree=out_tree or tree_structure([0] * len(outs)))


def top_level(eqn: jcore.JaxprEqn, nodes: range) -> bool:
  """``steps_of``'s ``enter`` that enters nothing: a step per top-level equation."""
  return False


def _one(resolved):
  """The one Key a value of an entered plain call stands for (or its Literal)."""
  return resolved if isinstance(resolved, jcore.Literal) else resolved[0]


def inlinable(eqn) -> bool:
  """A plain call: ``jit`` without explicit shardings, ``closed_call``."""
  if eqn.primitive.name not in CALLS:
    return False
  if eqn.primitive.name in ("jit", "pjit"):
    unspecified = lambda s: type(s).__name__ == "UnspecifiedValue"  # noqa: E731
    return (all(unspecified(s) for s in eqn.params["in_shardings"])
            and all(unspecified(s) for s in eqn.params["out_shardings"]))
  return True


def scan_counts(eqn: jcore.JaxprEqn) -> tuple[int, int]:
  """(number of constants, number of carries) of a ``scan``; its operands are constants,
  carries, then the sliced arrays (jax 0.10 has counts, 0.11 a flat tree of the three)."""
  p = eqn.params
  if "num_consts" in p:
    return p["num_consts"], p["num_carry"]
  consts, carry, _ = p["ft_in"].unpack()
  return len(consts), len(carry)


def live_across(program: Steps, steps: Sequence[Step]) -> tuple[list[Key], list[Key]]:
  """Keys that ``steps`` (some of ``program``'s, in order) read but do not define (their
  inputs), and keys they define that other steps or the program's outputs read (their
  outputs), in order."""
  defined = {k for s in steps for k in s.outputs if k is not None}
  inputs: dict[Key, None] = {}
  for s in steps:
    for a in s.inputs:
      if not isinstance(a, jcore.Literal) and a not in defined:
        inputs.setdefault(a, None)
  inside = {s.index for s in steps}
  later: set[Key] = {a for s in program.steps if s.index not in inside for a in s.inputs
                     if not isinstance(a, jcore.Literal)}
  later |= {a for a in program.outputs if not isinstance(a, jcore.Literal)}
  outputs = [k for s in steps for k in s.outputs if k is not None and k in later]
  return list(inputs), outputs


def nbytes(aval) -> int:
  """Bytes of one value of ``aval`` (0 for tokens and other non-arrays)."""
  shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
  if shape is None or dtype is None:
    return 0
  return math.prod(int(d) for d in shape) * dtype.itemsize


# -- evaluation: re-running a traced function step by step ------------------------------------
# A feature that changes *how* ``fn(params, *args)`` runs, never *what* it computes (the memory
# features, the gradient-sum rewrite, a stage's rolled layers or split scan), traces it
# (``trace_steps``) and evaluates the steps with its own rule; a re-bound equation keeps its
# name stack and context, so strategy frames stay visible and the HLO reads as before.

def trace_steps(fn: Callable, params: Any, args: Sequence[Any], *,
                in_device_memory: bool = False) -> tuple[Steps, list[Any]]:
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
  return steps_of(closed, num_params, jax.tree.structure(out_shape)), leaves


def _in_device_memory(x) -> jax.ShapeDtypeStruct:
  """``x``'s abstract value in device memory (keeping what a shard_map knows of it)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  if manual is None or manual.empty:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=aval.sharding, manual_axis_type=manual)


def in_context(step: Step, fn: Callable, *args, **kwargs):
  """Calls ``fn(*args)`` as if it were part of ``step``: same name stack and context, so what
  a feature inserts around an equation (a cast, a transfer) belongs to the same block."""
  with _context(step.eqn, step.name_stack):
    return fn(*args, **kwargs)


def bind(step: Step, invals: Sequence[Any], **params) -> list[Any]:
  """Binds ``step``'s primitive on ``invals`` under its own name stack and context."""
  return in_context(step, bind_here, step.eqn, invals, **params)


def read(env: dict, a: Any) -> Any:
  return a.val if isinstance(a, jcore.Literal) else env[a]


def run_steps(steps: Sequence[Step], env: dict,
              rule: Callable[[Step, list], list] = bind) -> None:
  """Evaluates ``steps`` in order with ``rule(step, invals) -> outvals``, reading and writing
  ``env`` (key -> value)."""
  for step in steps:
    outs = rule(step, [read(env, a) for a in step.inputs])
    env.update((k, v) for k, v in zip(step.outputs, outs) if k is not None)


def evaluate(program: Steps | Any, flat_args: Sequence[Any],
             rule: Callable[[Step, list], list] = bind, cast_back: bool = False) -> list[Any]:
  """The outputs of ``program`` (``Steps``, or a closed jaxpr whose plain calls are entered:
  a flat list) on ``flat_args``, each step evaluated by ``rule`` (``run_steps``; ``finish``
  says what ``cast_back`` does)."""
  if not isinstance(program, Steps):
    program = steps_of(program)
  env = start_env(program, flat_args)
  run_steps(program.steps, env, rule)
  return finish(program, env, cast_back)


def start_env(program: Steps, flat_args: Sequence[Any]) -> dict:
  return {**dict(program.consts), **dict(zip(program.inputs, flat_args))}


def finish(program: Steps, env: dict, cast_back: bool = False) -> Any:
  """The outputs of ``fn`` from ``env``, unflattened (cast to the traced dtypes if asked)."""
  outs = [read(env, a) for a in program.outputs]
  if cast_back:
    outs = [jax.lax.convert_element_type(o, aval.dtype)
            if hasattr(o, "dtype") and o.dtype != getattr(aval, "dtype", o.dtype) else o
            for o, aval in zip(outs, program.out_avals)]
  return jax.tree.unflatten(program.out_tree, outs)


def run_scan(step: Step, invals: Sequence[Any], body: Callable | None = None) -> list[Any]:
  """Re-binds a ``scan`` step through ``jax.lax.scan`` with ``body(consts, carry, x) ->
  carry + ys`` (lists; default: the traced body), so a feature can change how each iteration
  runs (rematerialize it, cast or gather its weights, average a statistic). Call inside
  ``in_context(step, ...)``."""
  p = step.eqn.params
  nc, nk = scan_counts(step.eqn)
  consts, carry, xs = list(invals[:nc]), list(invals[nc:nc + nk]), list(invals[nc + nk:])
  body = body or scan_body(step)

  def one(c, x):
    outs = list(body(consts, list(c), list(x)))
    return outs[:nk], outs[nk:]

  extra = {"_split_transpose": p["_split_transpose"]} if "_split_transpose" in p else {}
  carry, ys = jax.lax.scan(one, carry, xs, length=p["length"], reverse=p["reverse"],
                           unroll=p["unroll"], **extra)
  return list(carry) + list(ys)


def run_body(step: Step, invals: Sequence[Any], run: Callable[[Steps, list], list]) -> list[Any]:
  """Re-binds a ``scan`` or ``checkpoint`` step with its body, flattened into ``Steps``
  (numbered from the step's first node), evaluated by ``run(body, flat_args) -> flat outputs``
  once per iteration (``run_scan``) or rematerialized with the traced policy. Call inside
  ``in_context(step, ...)``."""
  p = step.eqn.params
  body = steps_of(p["jaxpr"], start=step.nodes.start)
  if step.primitive == "scan":
    return run_scan(step, invals, lambda consts, carry, x: run(body, [*consts, *carry, *x]))
  remat = jax.checkpoint(lambda *vals: run(body, list(vals)), prevent_cse=p["prevent_cse"],
                         policy=p["policy"])
  return list(remat(*invals))


def scan_body(step: Step) -> Callable:
  """The body of a ``scan`` step as ``body(consts, carry, x) -> carry + ys``."""
  fun = jcore.jaxpr_as_fun(step.eqn.params["jaxpr"])
  return lambda consts, carry, x: list(fun(*consts, *carry, *x))
