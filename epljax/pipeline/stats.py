"""Batch statistics in pipeline stages with several replicas (BatchNorm).

A stage is traced for one replica and sees that replica's rows of each micro batch, while on
one device a batch statistic is a mean over the whole micro batch. So where a stage's new
model state is computed from a mean over the rows (a ``reduce_sum`` over the rows divided by
their count, possibly through a broadcast: how ``jnp.mean``, ``jnp.var`` and Flax's
``BatchNorm`` write it), that sum is averaged over the replicas (``lax.pmean`` over the axes
the rows are split over) right where it is made; inside a ``scan`` (BatchNorm in layers under
``nn.scan``), in every iteration. Replicas hold equally many rows, so the average of their
means is the micro batch's mean. The normalization reads the same averaged value, and the
backward pass sums the statistics' cotangents over the replicas (``pmean``'s transpose): loss,
gradients and new state are the single-device ones.

A mean that is combined with the rows again (a normalization by it) is averaged the same way,
whether or not it is kept as state. Everything else a replica computes from its rows is its
own: a value that mixes rows in any other way (a sum or max over them, a slice, sort or
cumulative sum along them, a mean inside a ``while`` loop or a call) is *per replica*, in this
stage or passed on from an earlier one. New state that depends on a per-replica value, a
per-replica value combined with the rows again, state that keeps the rows themselves, and
random numbers drawn from model state (an NNX RNG stream: each replica would draw for its own
rows, not as one device does) are refused with the reason. The loss's own mean over the rows
stays per replica, as the pipeline averages the loss over replicas itself. State that does not
depend on the rows (kept as it is, or made from parameters) is the same on every replica and
needs nothing. These checks run for pipelines with model state and several replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
from jax.extend import core as jcore

from epljax.errors import PlanError, listing
from epljax.sharding import dims as D
from epljax.sharding import split_rules
from epljax.sharding.program import LOOPS, REMAT, Node, Program

RANDOM = frozenset({"random_bits", "threefry2x32", "random_fold_in", "random_split"})
# Between a mean's sum and its division by the count (``keepdims``, a widening cast).
_MEAN_VIEWS = frozenset({"broadcast_in_dim", "reshape", "convert_element_type"})


def batch_means(stages: Sequence, state_paths: Sequence[str],
                replicas: int) -> list[frozenset[int]]:
  """Per stage, the equations (ids) of its jaxpr or its scan bodies whose result is averaged
  over the replicas (module doc); raises ``PlanError`` where the new state would not be the
  single-device one. The stages are in pipeline order (stage ``s``'s outgoing activations are
  ``s + 1``'s incoming)."""
  found, incoming = [], ({}, {})      # per incoming index: its row dim; why it is per replica
  for stage in stages:
    check = _StageCheck(stage, incoming, state_paths, replicas)
    found.append(check.means)
    incoming = check.outgoing
  return found


class _StageCheck:

  def __init__(self, stage, incoming, state_paths, replicas):
    self.stage, self.paths, self.replicas = stage, state_paths, replicas
    program = self.program = Program(stage.jaxpr)
    n_p = len(stage.params) + len(stage.stacks)    # rolled layers' stacks follow the leaves
    n_s, n_in = len(stage.state), len(stage.incoming)
    first_batch = n_p + n_s + n_in
    in_rows, in_taint = incoming
    rows = {n_p + n_s + k: dim for k, dim in in_rows.items()}
    rows.update({i: 0 for i in range(first_batch, len(program.invars))
                 if D.shape(program.invars[i])})
    self.dims = split_rules.row_dims(program, rows, [D.shape(v) for v in program.invars[:n_p]],
                                     [f"parameter {i}" for i in range(n_p)])
    # Per-replica values: base -> why (the first place its replica's rows were mixed).
    self.taint = {program.invars[n_p + n_s + k]: why for k, why in in_taint.items()}
    outs = program.outputs
    state_out = outs[len(outs) - n_s:] if n_s else ()
    reach = {n.index for n in _reached([program.producer[b] for bases in state_out for b in bases
                                        if b in program.producer], program.node_producers)}
    # Averaged where the stage's evaluation reaches them: at its top level or in scan bodies.
    averaged = {n.index for n in program.nodes if all(e == "scan" for e in n.enclosing)
                and self._over_rows(n) and _is_mean(program, n)
                and (n.index in reach or self._meets_rows(n))}
    self.means = frozenset(id(program.nodes[i].eqn) for i in averaged)
    for node in program.nodes:
      self._visit(node, averaged)
    self._check_state(state_out, n_p)
    self.outgoing = ({}, {}) if stage.last else (
        {k: d for k, bases in enumerate(outs[:len(stage.outgoing)])
         if (d := self._row_dim(bases)) is not None},
        {k: why for k, bases in enumerate(outs[:len(stage.outgoing)])
         if (why := self._why(bases)) is not None})

  def _row_dim(self, bases):
    return next((self.dims.split[b] for b in bases if b in self.dims.split), None)

  def _why(self, bases):
    return next((self.taint[b] for b in bases if b in self.taint), None)

  def _meets_rows(self, node: Node) -> bool:
    """Whether ``node``'s result is combined with the rows again (a normalization by it)."""
    readers = _reached(self.program.node_consumers(node), self.program.node_consumers)
    return any(self.dims.split_dim(r, p) is not None for r in readers for p in range(len(r.inputs)))

  def _over_rows(self, node: Node) -> bool:
    dim = self.dims.split_dim(node, 0)
    return dim is not None and dim in node.eqn.params.get("axes", ())

  def _visit(self, node: Node, averaged) -> None:
    """Marks the outputs of ``node`` per replica when an input is, or when it mixes its
    replica's rows other than by an averaged mean."""
    why = next((w for bases in node.inputs if (w := self._why(bases)) is not None), None)
    if why is not None and any(self.dims.split_dim(node, p) is not None
                               for p in range(len(node.inputs))):
      raise PlanError(
          f"Pipeline stage '{self.stage.name}', with {self.replicas} replicas (each sees its own "
          f"rows of a micro batch) and model state, combines a value computed from one "
          f"replica's rows ({why}) with the rows again ({node.primitive} in "
          f"{'/'.join(node.frames) or 'the top level'}), so its result would differ from one "
          f"device's. Only means over the rows (sum / count, outside loops) are averaged over "
          f"the replicas. {_FIX}")
    if why is None and node.index not in averaged:
      row_inputs = [p for p in range(len(node.inputs)) if self.dims.split_dim(node, p) is not None]
      if row_inputs and not self._row_wise(node, row_inputs):
        why = f"{_what(node)} in {'/'.join(node.frames) or 'the top level'}"
        outer = [e for e in node.enclosing if e != "scan"]
        if self._over_rows(node) and outer:
          why += f", inside {_inside(outer[0])}"
        elif self._over_rows(node) and node.primitive == "reduce_sum":
          why += (", a mean that does not make its own stage's model state (only those are "
                  "averaged)" if _is_mean(self.program, node) else
                  ", not divided by the number of rows")
    if why is not None:
      self.taint.update((v, why) for v in node.eqn.outvars)

  def _row_wise(self, node: Node, row_inputs) -> bool:
    """Each output row computed from the same input rows alone (its row dim survives)."""
    eqn, prim = node.eqn, node.primitive
    if not eqn.outvars or self.dims.split.get(eqn.outvars[0]) is None:
      return False      # the rows were reduced, sliced, mixed, or the op is not followed
    dim = {p: self.dims.split_dim(node, p) for p in row_inputs}
    if prim == "dot_general":
      (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
      if len(row_inputs) == 2:    # rows against rows: only as a batch dim, paired
        return dim[0] in lb and dim[1] in rb and lb.index(dim[0]) == rb.index(dim[1])
      return dim[row_inputs[0]] not in (lc, rc)[row_inputs[0]]
    if prim == "conv_general_dilated":
      return row_inputs == [0] and dim[0] == eqn.params["dimension_numbers"].lhs_spec[0]
    if prim == "gather":     # a lookup by row-carrying indices, or a slice within each row
      dnums = eqn.params["dimension_numbers"]
      if 0 not in row_inputs or 1 not in row_inputs or all(
          D.shape(eqn.invars[p])[dim[p]] == 1 for p in row_inputs):   # one row: nothing mixes
        return True
      batching = tuple(getattr(dnums, "operand_batching_dims", ()))
      return dim[0] in batching and tuple(dnums.start_indices_batching_dims)[
          batching.index(dim[0])] == dim[1]
    if prim.startswith("reduce_") or prim in ("argmax", "argmin"):
      return not self._over_rows(node)
    survives = D.passes(eqn, dim[row_inputs[0]])   # structural ops: the row dim kept whole
    return (D.is_elementwise(eqn) or prim in D.SHAPE_OPS
            or not isinstance(survives, bool) and survives is not None)

  def _check_state(self, state_out, n_p) -> None:
    stage = self.stage
    program = self.program
    state_in = set(program.invars[n_p:n_p + len(stage.state)])
    for j, bases in enumerate(state_out):
      where = (f"Model state '{self.paths[stage.state[j]]}' of pipeline stage '{stage.name}', "
               f"with {self.replicas} replicas (each sees its own rows of a micro batch),")
      if self._row_dim(bases) is not None:
        raise PlanError(f"{where} keeps the batch rows themselves, which differ per replica. "
                        f"{_FIX}")
      why = self._why(bases)
      if why is not None:
        raise PlanError(f"{where} is computed from its replica's rows alone: {why}. Only means "
                        f"over the rows (sum / count, outside loops) are averaged over the "
                        f"replicas. {_FIX}")
    # An RNG stream: random numbers drawn from a key or counter kept as model state.
    from_state = set(state_in)
    for node in program.nodes:
      if any(b in from_state for bases in node.inputs for b in bases):
        if node.primitive in RANDOM:
          raise PlanError(
              f"Pipeline stage '{stage.name}', with {self.replicas} replicas (each sees its own "
              f"rows of a micro batch), draws random numbers ({node.primitive} in "
              f"{'/'.join(node.frames) or 'the top level'}) from its model state (an RNG "
              f"stream: {listing([self.paths[j] for j in stage.state])}): each replica would "
              "draw for its own rows, not as one device does for the whole micro batch. "
              + _FIX)
        from_state.update(node.eqn.outvars)


def _reached(start: Iterable[Node], step: Callable[[Node], Iterable[Node]]) -> Iterator[Node]:
  """The nodes ``start`` and those reached from them by ``step`` (``Program.node_producers``,
  ``node_consumers``), each once."""
  seen, todo = set(), list(start)
  while todo:
    node = todo.pop()
    if node.index not in seen:
      seen.add(node.index)
      yield node
      todo.extend(step(node))


def _is_mean(program: Program, node: Node) -> bool:
  """A floating ``reduce_sum`` each of whose readers divides it by the number of elements it
  sums (through broadcasts, reshapes and widening casts)."""
  if node.primitive != "reduce_sum" or not np.issubdtype(node.eqn.outvars[0].aval.dtype,
                                                        np.inexact):
    return False
  shape = D.shape(node.eqn.invars[0])
  count = int(np.prod([shape[a] for a in node.eqn.params["axes"]]))

  def divided(var) -> bool:
    readers = program.consumers.get(var, ())
    if not readers or any(var in bases for bases in program.outputs):
      return False
    for reader, pos in readers:
      if reader.primitive in _MEAN_VIEWS and pos == 0 and np.issubdtype(
          reader.eqn.outvars[0].aval.dtype, np.inexact):
        if not divided(reader.eqn.outvars[0]):
          return False
      elif not (reader.primitive == "div" and pos == 0 and isinstance(
          reader.eqn.invars[1], jcore.Literal) and np.all(np.asarray(
              reader.eqn.invars[1].val) == count)):
        return False
    return True

  return divided(node.eqn.outvars[0])


def _what(node: Node) -> str:
  return f"{node.primitive} over the rows" if node.eqn.params.get("axes") is not None else (
      f"{node.primitive} along the rows")


def _inside(primitive: str) -> str:
  if primitive in LOOPS:
    return f"a {primitive} loop (only scans average their statistics per iteration)"
  if primitive in REMAT:
    return "a rematerialized call (jax.checkpoint, nn.remat)"
  return f"a {primitive} call"


_FIX = ("Give each stage all of a replica's devices (epl.replicate(k, name=...) with k the "
        "devices per stage), so that one replica sees whole micro batches, or make the state "
        "from means over the batch, as BatchNorm's statistics are.")
