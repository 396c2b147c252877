"""Stage functions cut from the captured program.

The capture (``sharding.capture``) gives every innermost equation its task graph; consecutive
task graphs that are not colocated are pipeline stages. This module walks the top-level
equations of the traced loss and gives each to the stage of its equations. A call-like
equation (``pjit``, ``custom_jvp_call``, ``checkpoint`` ...) whose body spans stages is inlined
and cut inside; a loop or branch that spans stages is an error (its iterations cannot run on
two devices). Each stage becomes one ``ClosedJaxpr``:

    stage s: (its parameters..., incoming activations..., batch leaves...)
             -> (outgoing activations...)            for s < S - 1
             -> (loss, aux leaves...)                for the last stage

The outgoing activations of stage ``s`` are the values computed on stages ``<= s`` and used
after it (a value used two stages later passes through the stage in between). Parameters never
travel: every stage that reads a parameter takes it as its own input, so a parameter used by two
stages (tied input and output embeddings) is held by both and the pipeline sums its two
gradients (``Stage.params`` of both name it; ``shared_params`` lists them), except a stacked
parameter that stage ``s`` reads only through the ``s``-th of ``S`` equal row chunks (scanned
layers split per stage, ``chunks.py``): each stage takes its own chunk (a *part*). Every stage
reads the batch itself, so labels reach the last stage without travelling; values computed
from the batch alone (masks, one-hot labels) are recomputed where they are used rather than
sent. A value flowing from a later stage to an earlier one is an error naming both.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.extend import source_info_util

from epljax.errors import PlanError
from epljax.pipeline import chunks
from epljax.pipeline.roll import Run, roll_repeats
from epljax.sharding import constraints
from epljax.sharding.capture import Capture
from epljax.sharding.program import (CALLS, DERIVATIVE_CALLS, Key, Step, bind, evaluate,
                                     in_context, inner_eqns, run_scan, walk)

# Call-like primitives whose body may be cut between stages (inlined). Inlining a custom
# derivative rule or a checkpoint that straddles two stages falls back to differentiating its
# body, which gives the same gradients (up to the rule's numerical tricks) without remat.
_INLINABLE = CALLS | DERIVATIVE_CALLS


class _Key:
  """One value of the flattened program: a program input, a constant or an equation output."""
  __slots__ = ("aval", "kind", "index", "value")

  def __init__(self, aval, kind: str, index: int = -1, value: Any = None):
    self.aval, self.kind, self.index, self.value = aval, kind, index, value


@dataclasses.dataclass(eq=False)
class _Item:
  eqn: jcore.JaxprEqn
  inputs: list[Any]            # _Key or jcore.Literal per operand
  outputs: list[_Key | None]   # None for a dropped output
  stage: int | None
  name_stack: Any              # its name stack, under the calls it was inlined from


@dataclasses.dataclass(frozen=True)
class Stage:
  """One pipeline stage: ``fn(params, incoming, batch, state) -> (outgoing, loss, aux,
  new_state)``."""
  index: int
  name: str
  jaxpr: jcore.ClosedJaxpr
  params: tuple[int, ...]        # parameter leaf indices, in the order the jaxpr takes them
                                 # (a parameter read by several stages is in each of them),
                                 # then its parts (``parts``: numbered after the leaves)
  incoming: tuple[Any, ...]      # avals
  outgoing: tuple[Any, ...]      # avals
  last: bool
  state: tuple[int, ...] = ()    # model state leaf indices (BatchNorm statistics) it updates
  rolled: Run | None = None      # its repeated layers, run as one ``lax.scan`` (``roll.py``)
  # The rolled scan's stacked parameters, inputs of ``jaxpr`` after ``params``: per stack, the
  # position in ``params`` of each block's leaf (the loop slices them from its parameter
  # buffer, ``packing.Layout.unpack_stacked``).
  stacks: tuple[tuple[int, ...], ...] = ()
  unrolled: str = ""             # why repeated layers found here were left unrolled
  # Its chunks of stacked parameters: (index in ``params``, the user's leaf). A part's index is
  # ``num_params + j`` (the ``j``-th chunked leaf); its value is the stage's chunk of the leaf.
  parts: tuple[tuple[int, int], ...] = ()
  # Batch statistics with several replicas (``stats.py``): the equations (ids, in its jaxpr or
  # the bodies of its scans) whose result is averaged over ``row_axes``, the mesh axes a micro
  # batch's rows are split over.
  averaged: frozenset[int] = frozenset()
  row_axes: tuple[str, ...] = ()

  def read_directly(self) -> frozenset[int]:
    """Positions in ``params`` whose leaf the program reads itself, not only as a row of one
    of its ``stacks``."""
    jaxpr = self.jaxpr.jaxpr
    used = {v for e in jaxpr.eqns for v in e.invars if not isinstance(v, jcore.Literal)}
    used |= {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
    return frozenset(p for p, v in enumerate(jaxpr.invars[:len(self.params)]) if v in used)

  def __call__(self, params: Sequence[Any], incoming: Sequence[Any], batch: Sequence[Any],
               state: Sequence[Any] = ()):
    """``params``: the stage's parameter leaves, then its stacks."""
    args = (*params, *state, *incoming, *batch)
    with constraints.explained(f"stage '{self.name}'"):
      outs = (_averaging(self.jaxpr, self.averaged, self.row_axes, args) if self.averaged else
              jcore.jaxpr_as_fun(self.jaxpr)(*args))
    new_state = tuple(outs[len(outs) - len(self.state):])
    outs = outs[:len(outs) - len(self.state)]
    n = len(self.outgoing)
    if not self.last:
      return tuple(outs[:n]), None, (), new_state
    return (), outs[n], tuple(outs[n + 1:]), new_state


def _averaging(closed: jcore.ClosedJaxpr, averaged: frozenset[int], axes: Sequence[str],
               args: Sequence[Any]) -> list[Any]:
  """``closed`` evaluated on ``args``, the results of the equations ``averaged`` (their ids)
  replaced by their mean over the mesh ``axes`` (inside the pipeline's ``shard_map``). A scan
  holding one runs with its body evaluated the same way: every iteration averages its own."""
  def rule(step, invals):
    if step.primitive == "scan" and any(id(e) in averaged for e in inner_eqns(step.eqn)):
      body = lambda consts, carry, x: _averaging(  # noqa: E731
          step.eqn.params["jaxpr"], averaged, axes, [*consts, *carry, *x])
      outs = in_context(step, run_scan, step, invals, body)
    else:
      outs = bind(step, invals)
    return [lax.pmean(o, tuple(axes)) for o in outs] if id(step.eqn) in averaged else outs

  return evaluate(closed, args, rule)


def cut_stages(cap: Capture, stage_of: Sequence[int], num_params: int, num_state: int,
               roll: bool) -> tuple[Stage, ...]:
  """The stages of the captured program ``(params..., state..., batch...) -> (loss, aux...,
  new_state...)``.

  ``stage_of`` maps task graph index -> stage; the first ``num_params`` program inputs are
  parameters, the next ``num_state`` model state (each leaf read and updated by one stage,
  its new value among the last ``num_state`` outputs); the rest are batch leaves, read by
  every stage. ``roll``: each stage's repeated layers become one ``lax.scan`` (``roll.py``).
  A stage reading only its own row chunk of a stacked parameter takes that chunk (a part).
  """
  cutter = _Cutter(cap, stage_of, num_params, num_state)
  cutter.run()
  cutter.check_state(list(cap.input_paths[num_params:num_params + num_state]))
  stages = cutter.build()
  if not roll:
    return stages
  return tuple(_roll(s) for s in stages)


def _roll(stage: Stage) -> Stage:
  """``stage`` with its repeated layers as one scan over stacked parameters (``roll.py``)."""
  rolled = roll_repeats(stage.jaxpr, len(stage.params))
  return dataclasses.replace(stage, jaxpr=rolled.jaxpr, rolled=rolled.run,
                             stacks=rolled.stacks, unrolled=rolled.why_not)


class _Cutter:

  def __init__(self, cap: Capture, stage_of: Sequence[int], num_params: int, num_state: int):
    self.cap = cap
    self.node_tg = cap.node_taskgraph
    self.stage_of = list(stage_of)
    self.num_stages = max(self.stage_of) + 1
    self.names = [""] * self.num_stages
    for tg in cap.taskgraphs:
      self.names[self.stage_of[tg.index]] = self.names[self.stage_of[tg.index]] or tg.name
    closed = cap.program.closed_jaxpr
    num_vars = num_params + num_state
    self.inputs = [_Key(v.aval, "param" if i < num_vars else "batch", i)
                   for i, v in enumerate(closed.jaxpr.invars)]
    self.num_params = num_params
    self.num_state = num_state
    self.num_vars = num_vars
    self.param_stage = [
        self.stage_of[tg] if tg is not None else 0 for tg in cap.input_taskgraph[:num_vars]]
    self.state_outputs: list[Any] = []
    self.items: list[_Item] = []
    self.producer: dict[_Key, int] = {}   # key -> item index
    self.outputs: list[Any] = []
    self.batch_only: set[_Key] = set()
    self.part_nodes, self.chunked = self._find_parts()
    self.part_keys: dict[tuple[int, int], _Key] = {}

  def _find_parts(self) -> tuple[dict[int, tuple[int, int]], list[int]]:
    """The slices that give stage ``s`` the ``s``-th row chunk of a stacked parameter
    (node -> (leaf, chunk)), for the leaves read only that way; and those leaves. A stack of
    scanned layers that cannot be one (also read another way) warns: ``PipelineWarning``."""
    program, found, leaves, whole_stacks = self.cap.program, {}, [], []
    if self.num_stages == 1:
      return found, leaves
    for leaf in range(self.num_params):
      shape = tuple(program.invars[leaf].aval.shape)
      mine: dict[int, int] = {}
      scanned = set()            # the chunks sliced for a scan over layers
      why: dict[str, str] = {}   # why the leaf is held whole: the first reason of each kind
      for n, _ in program.uses_of_input(leaf):
        c = chunks.chunk_of(n, shape, self.num_stages)
        if c is not None and chunks.feeds_scan(program, n):
          scanned.add(c)
        # The slice and everything reading it are on stage c (else the stage holds the leaf).
        stages = {self.stage_of[self.node_tg[r.index]] if self.node_tg[r.index] >= 0 else None
                  for r in [n, *program.node_consumers(n)]}
        if c is None:
          why.setdefault("read", f"a {n.eqn.primitive.name} reads it other than as one stage's "
                         "chunk")
        elif c in mine.values():
          why.setdefault("twice", f"its chunk {c} is sliced twice")
        elif stages != {c}:
          why.setdefault("stage", f"its chunk {c} is read outside stage {c}")
        else:
          mine[n.index] = c
      if not why and mine:
        found.update((i, (leaf, c)) for i, c in mine.items())
        leaves.append(leaf)
      elif len(scanned) > 1:    # scanned layers the stages share out, held whole
        kind = "read" if "read" in why else next(iter(why))
        whole_stacks.append((self.cap.input_paths[leaf], program.invars[leaf].aval,
                             kind == "read", why[kind]))
    if whole_stacks:
      chunks.warn_whole_stacks(whole_stacks, self.num_stages)
    return found, leaves

  # -- walking ------------------------------------------------------------------------------
  def run(self) -> None:
    closed = self.cap.program.closed_jaxpr
    flat = walk(closed, self._enter)
    keys: dict[Key, Any] = dict(zip(flat.inputs, self.inputs))
    keys.update({key: _Key(key[1].aval, "const", value=c) for key, c in flat.consts})
    for visit in flat.steps:
      self._add(visit, keys)
    self.outputs = [_resolve(keys, r) for r in flat.outputs]
    if self.num_state:
      self.state_outputs = self.outputs[-self.num_state:]
      self.outputs = self.outputs[:-self.num_state]
    self._assign_untagged()
    self.batch_only = self._find_batch_only()
    self._check_order()

  def _stages(self, nodes: range) -> list[int]:
    """The stages of the capture's ``nodes``' task graphs."""
    return sorted({self.stage_of[t] for t in self.node_tg[nodes.start:nodes.stop] if t >= 0})

  def _enter(self, eqn: jcore.JaxprEqn, nodes: range) -> bool:
    """A call-like equation is inlined where its body spans stages (module doc)."""
    stages = self._stages(nodes)
    if len(stages) < 2:
      return False
    if eqn.primitive.name not in _INLINABLE or any(
        isinstance(v, jcore.Jaxpr) and v.constvars for v in eqn.params.values()):
      names = ", ".join(f"'{self.names[s]}'" for s in stages)
      raise PlanError(_SPANS.format(prim=eqn.primitive.name, where=_where(eqn), names=names))
    return True

  def _add(self, visit: Step, keys: dict) -> None:
    eqn, nodes = visit.eqn, visit.nodes
    if len(nodes) == 1 and nodes.start in self.part_nodes:   # a stage's chunk of a stacked leaf
      leaf, c = self.part_nodes[nodes.start]
      keys[visit.outputs[0]] = self.part_keys.setdefault(
          (leaf, c), _Key(eqn.outvars[0].aval, "part", leaf, c))
      return
    stages = self._stages(nodes)
    outs = [None if o is None else _Key(v.aval, "node", len(self.items))
            for v, o in zip(eqn.outvars, visit.outputs)]
    for o, k in zip(visit.outputs, outs):
      if k is not None:
        keys[o] = k
        self.producer[k] = len(self.items)
    self.items.append(_Item(eqn, [_resolve(keys, r) for r in visit.inputs], outs,
                            stages[0] if stages else None, visit.name_stack))

  # -- stages of untagged equations, and the order check -------------------------------------
  def _stage_of_key(self, key: Any) -> int:
    if not isinstance(key, _Key) or key.kind in ("batch", "const"):
      return 0
    if key.kind == "param":
      return self.param_stage[key.index]
    if key.kind == "part":
      return key.value
    return self.items[self.producer[key]].stage

  def _assign_untagged(self) -> None:
    """Equations without a task graph (no work of their own) follow their inputs."""
    for item in self.items:
      if item.stage is None:
        item.stage = max([self._stage_of_key(k) for k in item.inputs], default=0)

  def _check_order(self) -> None:
    for item in self.items:
      for key in item.inputs:
        if isinstance(key, _Key) and key.kind == "node" and key not in self.batch_only:
          producer = self.items[self.producer[key]]
          if producer.stage > item.stage:
            order = " -> ".join(f"'{n}'" for n in self.names)
            raise PlanError(_BACKWARDS.format(
                consumer=self.names[item.stage], producer=self.names[producer.stage],
                prim=item.eqn.primitive.name, where=_where(item.eqn),
                made=producer.eqn.primitive.name, made_where=_where(producer.eqn), order=order))

  # -- stage jaxprs -------------------------------------------------------------------------
  def _find_batch_only(self) -> set[_Key]:
    """Keys computed from batch leaves and constants alone (cheap to recompute anywhere)."""
    only: set[_Key] = set()
    for item in self.items:
      if item.eqn.effects:
        continue
      if all(not isinstance(k, _Key) or k.kind in ("batch", "const") or k in only
             for k in item.inputs):
        only.update(k for k in item.outputs if k is not None)
    return only

  def build(self) -> tuple[Stage, ...]:
    n_stages = self.num_stages
    members: list[set[int]] = [set() for _ in range(n_stages)]
    for i, item in enumerate(self.items):
      members[item.stage].add(i)
    # Where each value is read. A stage that reads a batch-only value made elsewhere takes the
    # equations that make it instead (their inputs are batch-only too, so they follow).
    used_at: dict[_Key, set[int]] = {}
    for s in range(n_stages):
      pending = sorted(members[s])

      def read(k: Any, s=s, pending=pending) -> None:
        if not isinstance(k, _Key) or k.kind in ("batch", "const"):
          return
        used_at.setdefault(k, set()).add(s)
        if k in self.batch_only and self.producer[k] not in members[s]:
          members[s].add(self.producer[k])
          pending.append(self.producer[k])

      if s == n_stages - 1:
        for k in self.outputs:
          read(k)
      for j, k in enumerate(self.state_outputs):
        if self.state_owner(j) == s:
          read(k)
      while pending:
        for k in self.items[pending.pop()].inputs:
          read(k)
    # Boundary b carries the values made on stages <= b and read after b (parameters are
    # inputs of every stage that reads them, never sent).
    boundary: list[list[_Key]] = [[] for _ in range(n_stages - 1)]
    made = [(k, item.stage) for item in self.items for k in item.outputs if k is not None]
    for k, p in made:
      if k not in self.batch_only:
        for b in range(p, max(used_at.get(k, {p}))):
          boundary[b].append(k)
    return tuple(self._stage(s, sorted(members[s]), boundary) for s in range(n_stages))

  @functools.cached_property
  def read_params(self) -> set[int]:
    """The parameter leaves some equation (or the program's outputs) reads."""
    keys = [k for item in self.items for k in item.inputs] + self.outputs + self.state_outputs
    return {k.index for k in keys if isinstance(k, _Key) and k.kind == "param"} | set(
        self.chunked)

  def _stage(self, s: int, member: list[int], boundary: list[list[_Key]]) -> Stage:
    last = s == self.num_stages - 1
    var: dict[_Key, jcore.Var] = {}
    constvars, consts = [], []

    def new(k: _Key) -> jcore.Var:
      var[k] = jcore.Var(k.aval)
      return var[k]

    def use(k: Any) -> Any:
      if not isinstance(k, _Key):
        return k   # a Literal
      if k not in var:
        if k.kind != "const":   # internal invariant: routing must have provided it
          raise AssertionError(f"stage {s} reads a value it was not given ({k.kind})")
        constvars.append(new(k))
        consts.append(k.value)
      return var[k]

    reads = [k for i in member for k in self.items[i].inputs if isinstance(k, _Key)]
    reads += [k for k in self.outputs if isinstance(k, _Key)] if last else []
    order = list(dict.fromkeys(k.index for k in reads
                               if k.kind == "param" and k.index < self.num_params))
    # A parameter no stage reads is held (with a zero gradient) by the stage of its task graph.
    order += [i for i in range(self.num_params)
              if i not in self.read_params and self.param_stage[i] == s]
    state = [j for j in range(self.num_state) if self.state_owner(j) == s]
    parts = list(dict.fromkeys(k for k in reads if k.kind == "part"))
    incoming = boundary[s - 1] if s > 0 else []
    invars = [new(self.inputs[i]) for i in order] + [new(k) for k in parts]
    invars += [new(self.inputs[self.num_params + j]) for j in state]
    invars += [new(k) for k in incoming]
    invars += [new(k) for k in self.inputs[self.num_vars:]]
    eqns = []
    for i in member:
      item = self.items[i]
      ins = [use(k) for k in item.inputs]
      outs = [jcore.DropVar(v.aval) if k is None else new(k)
              for v, k in zip(item.eqn.outvars, item.outputs)]
      info = item.eqn.source_info.replace(name_stack=item.name_stack)
      eqns.append(jcore.new_jaxpr_eqn(ins, outs, item.eqn.primitive, item.eqn.params,
                                      item.eqn.effects, info, item.eqn.ctx))
    outgoing = [] if last else boundary[s]
    outvars = [use(k) for k in outgoing]
    if last:
      outvars += [use(k) for k in self.outputs]
    outvars += [use(self.state_outputs[j]) for j in state]
    effects = set().union(*(e.effects for e in eqns)) if eqns else jcore.no_effects
    info = jcore.DebugInfo("epljax pipeline", f"stage {self.names[s]}",
                           tuple(f"in{i}" for i in range(len(invars))),
                           tuple(f"out{i}" for i in range(len(outvars))))
    jaxpr = jcore.Jaxpr(constvars, invars, outvars, eqns, effects, info)
    if any(k.value != s for k in parts):   # internal invariant: _find_parts checked readers
      raise AssertionError(f"stage {s} reads another stage's chunk of a stacked parameter")
    virtual = [(self.num_params + self.chunked.index(k.index), k.index) for k in parts]
    return Stage(s, self.names[s], jcore.ClosedJaxpr(jaxpr, consts),
                 tuple(order) + tuple(v for v, _ in virtual),
                 tuple(k.aval for k in incoming), tuple(k.aval for k in outgoing), last,
                 tuple(state), parts=tuple(virtual))

  # -- model state ----------------------------------------------------------------------------
  def state_owner(self, j: int) -> int:
    """The stage that reads model state leaf ``j`` and keeps its new value."""
    return self.param_stage[self.num_params + j]

  def check_state(self, paths: Sequence[str]) -> None:
    """Each model state leaf is read by one stage, and its new value is made there (or
    before it)."""
    readers: dict[int, set[int]] = {}
    for item in self.items:
      for k in item.inputs:
        if isinstance(k, _Key) and k.kind == "param" and k.index >= self.num_params:
          readers.setdefault(k.index - self.num_params, set()).add(item.stage)
    for j, k in enumerate(self.state_outputs):
      where = readers.get(j, set())
      made = self._stage_of_key(k) if isinstance(k, _Key) else 0
      owner = self.state_owner(j)
      if len(where) > 1 or made > owner:
        names = ", ".join(f"'{self.names[s]}'" for s in sorted(where | {made}))
        raise PlanError(_STATE_SPANS.format(path=paths[j], names=names))


def shared_params(stages: Sequence[Stage]) -> dict[int, tuple[int, ...]]:
  """Parameter leaf -> the stages holding it, for the parameters held by more than one."""
  holders: dict[int, list[int]] = {}
  for stage in stages:
    own = {v for v, _ in stage.parts}
    for i in stage.params:
      if i in own:
        continue
      holders.setdefault(i, []).append(stage.index)
  return {i: tuple(h) for i, h in holders.items() if len(h) > 1}


def _resolve(keys: dict, resolved: Any) -> Any:
  """The ``_Key`` of a walked value (one key: only single-body calls are entered), or its
  Literal."""
  return resolved if isinstance(resolved, jcore.Literal) else keys[resolved[0]]


def _where(eqn: jcore.JaxprEqn) -> str:
  return source_info_util.summarize(eqn.source_info)


def same_consts(a: Sequence[Any], b: Sequence[Any]) -> bool:
  return len(a) == len(b) and all(
      np.shape(x) == np.shape(y) and np.asarray(x).dtype == np.asarray(y).dtype
      and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))


_SPANS = """\
The operation `{prim}` at {where} contains work of pipeline stages {names}; a stage
boundary cannot fall inside a loop or a branch, whose iterations run on one device. Keep
each loop inside one stage: scan over the layers of one stage only, or put the
`with epl.replicate(1, name=...)` scope (or the `epl.set_default_strategy` call) outside it."""

_STATE_SPANS = """\
Model state '{path}' is used by pipeline stages {names}; a model state leaf (BatchNorm
statistics) must be read and updated inside one stage, whose devices keep it between micro
batches. Keep the layer that owns it, and every use of its value, inside one stage's scope."""

_BACKWARDS = """\
Pipeline stage '{consumer}' uses a value computed in stage '{producer}', which runs after it:
`{prim}` at {where} reads the result of `{made}` at {made_where}.
Stages run in the order their first operation was traced ({order}), and a stage can only use
values of the stages before it. Compute the value inside the earlier stage's scope."""
