"""Batch statistics in pipeline stages with several replicas (BatchNorm).

A stage is traced for one replica and sees that replica's rows of each micro batch, while on
one device a batch statistic is a mean over the whole micro batch. So where a stage's new
model state is computed from a mean over the rows (a ``reduce_sum`` over the rows divided by
their count: how ``jnp.mean`` and Flax's ``BatchNorm`` write it), that sum is averaged over
the replicas (``lax.pmean`` over the axes the rows are split over) right where it is made.
Replicas hold equally many rows, so the average of their means is the micro batch's mean. The
normalization reads the same averaged value, and the backward pass sums the statistics'
cotangents over the replicas (``pmean``'s transpose): loss, gradients and new state are the
single-device ones.

Refused, with the reason: model state computed from a reduction over the rows that is not a
mean (a sum not divided by its row count, a max, a matmul over the rows) or that sits inside a
loop or branch; state that keeps the rows themselves; and state that does not come from the
rows at all (an NNX RNG stream: each replica would draw random numbers for its own rows, not
the single-device draws).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jax.extend import core as jcore

from epljax.errors import PlanError
from epljax.sharding import dims as D
from epljax.sharding import split_rules
from epljax.sharding.program import Node, Program

_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})


def batch_means(stages: Sequence, state_paths: Sequence[str], replicas: int) -> list[tuple]:
  """Per stage, the indices of the top-level equations of its jaxpr whose result is averaged
  over the replicas (module doc); raises ``PlanError`` where that would not be exact. The
  stages are in pipeline order (stage ``s``'s outgoing activations are ``s + 1``'s
  incoming)."""
  found, incoming = [], {}
  for stage in stages:
    program = Program(stage.jaxpr)
    n_p, n_s, n_in = len(stage.params), len(stage.state), len(stage.incoming)
    first_batch = n_p + n_s + n_in
    rows = {n_p + n_s + k: dim for k, dim in incoming.items()}
    rows.update({i: 0 for i in range(first_batch, len(program.invars))
                 if D.shape(program.invars[i])})
    dims = split_rules.row_dims(program, rows, [D.shape(v) for v in program.invars[:n_p]],
                                [f"parameter {i}" for i in range(n_p)])

    def row_dim(bases, dims=dims):
      return next((dims.split[b] for b in bases if b in dims.split), None)

    outs = program.outputs
    incoming = {} if stage.last else {
        k: d for k, bases in enumerate(outs[:len(stage.outgoing)])
        if (d := row_dim(bases)) is not None}
    if not n_s:
      found.append(())
      continue
    top = {id(e): i for i, e in enumerate(stage.jaxpr.jaxpr.eqns)}
    means = set()
    for j, bases in enumerate(outs[len(outs) - n_s:]):
      where = (f"Model state '{state_paths[stage.state[j]]}' of pipeline stage "
               f"'{stage.name}', with {replicas} replicas (each sees its own rows of a micro "
               "batch),")
      if row_dim(bases) is not None:
        raise PlanError(f"{where} keeps the batch rows themselves, which differ per "
                        f"replica. {_FIX}")
      reductions = [n for n in _producers(program, bases) if _over_rows(n, dims)]
      if not reductions:
        raise PlanError(f"{where} is not computed from the batch rows (an RNG stream, a "
                        "counter): each replica would draw or count for its own rows, not as "
                        f"one device does for the whole micro batch. {_FIX}")
      for node in reductions:
        problem = (f"inside a {node.enclosing[0]}" if node.enclosing else
                   None if _is_mean(program, node) else
                   "not a mean (a sum that is not divided by its row count, a max, a matmul "
                   "over the rows)")
        if problem is not None:
          raise PlanError(
              f"{where} comes from a reduction over the rows ({node.primitive} in "
              f"{'/'.join(node.frames) or 'the top level'}) that is {problem}, so it cannot "
              f"be averaged over the replicas exactly. {_FIX}")
        means.add(top[id(node.eqn)])
    found.append(tuple(sorted(means)))
  return found


def _producers(program: Program, bases) -> list[Node]:
  """Every node the values ``bases`` are computed from, in program order."""
  seen: dict[int, Node] = {}
  todo = [program.producer[b] for b in bases if b in program.producer]
  while todo:
    node = todo.pop()
    if node.index not in seen:
      seen[node.index] = node
      todo.extend(program.node_producers(node))
  return [seen[i] for i in sorted(seen)]


def _over_rows(node: Node, dims) -> bool:
  """Whether ``node`` combines values of different rows (reduces, accumulates or contracts
  over the rows)."""
  dim = dims.split_dim(node, 0)
  if node.primitive == "dot_general":
    (lc, rc), _ = node.eqn.params["dimension_numbers"]
    right = dims.split_dim(node, 1)
    return (dim is not None and dim in lc) or (right is not None and right in rc)
  if dim is None:
    return False
  if node.primitive in _CUMULATIVE:
    return node.eqn.params["axis"] == dim
  return "axes" in node.eqn.params and dim in node.eqn.params["axes"]


def _is_mean(program: Program, node: Node) -> bool:
  """A ``reduce_sum`` each of whose readers divides it by the number of elements it sums."""
  if node.primitive != "reduce_sum":
    return False
  shape = D.shape(node.eqn.invars[0])
  count = int(np.prod([shape[a] for a in node.eqn.params["axes"]]))
  out = node.eqn.outvars[0]
  readers = program.consumers.get(out, ())
  return bool(readers) and not any(out in bases for bases in program.outputs) and all(
      r.primitive == "div" and pos == 0 and isinstance(r.eqn.invars[1], jcore.Literal)
      and np.all(np.asarray(r.eqn.invars[1].val) == count) for r, pos in readers)


_FIX = ("Give each stage all of a replica's devices (epl.replicate(k, name=...) with k the "
        "devices per stage), so that one replica sees whole micro batches, or compute the "
        "state from means over the batch (BatchNorm's statistics are).")
