"""Gradient partial sums added on each device before they are all-reduced, once.

GSPMD all-reduces a partial sum where it is produced. When two partials of one gradient are
added afterwards, that is two all-reduces where one would do; XLA's GPU pipeline merges them
(``AllReduceReassociate``), its CPU pipeline cannot. So the rewrite runs on ``PLATFORMS``
alone (the build says why not elsewhere, in the plan). Measured on the zoo models split 4 x 2
(``bench/gpu_compile.py``, XLA:GPU compiling for 8 H100s): without the rewrite XLA:GPU's
all-reduces are within 5% of the rewrite's bytes (gemma 162 vs 154 KiB, gpt2 101 vs 97, the
rest equal), XLA:CPU's up to 30% over (llama 210 vs 162). Two places in a split model make
them:

- **Sibling column matmuls** (``model`` axis). Megatron's first matmuls of a split region
  (attention's q, k and v projections, a gated MLP's gate and up) read one unsplit activation
  ``x``; the gradient of ``x`` through each is a partial sum over ``model``. They run in one
  ``shard_map`` manual over ``model`` only, where ``x`` is made device-varying once
  (``lax.pcast``): the transpose of that one cast is the one all-reduce (Megatron's ``f``).
- **A parameter read by several row-wise ops** (``data`` axis): a tied embedding, looked up
  by the first layer and multiplied by the last. Each use's gradient is a partial sum over the
  rows of the batch. The parameter enters a ``shard_map`` manual over ``data`` once, as one
  device-varying copy per replica (a ``(replicas, ...)`` array, one slice per device, no
  memory beyond the parameter's), and each use reads its replica's copy inside its own
  ``shard_map`` over ``data``, on its rows. The uses' gradients add up in that copy; the
  transpose of the one cast all-reduces the sum.

The equations themselves are the traced ones, bound on each device's shard, so values are
unchanged up to the order of the final sum. Everything else (``data`` inside the matmul maps,
``model`` inside the row maps) stays GSPMD's.

Which weights are column-split, and on which dimension, is the plan's (``model`` in the
parameter's ``PartitionSpec``); ``split_rules`` follows each weight, and the batch's rows,
through the program to the equations that read them. Siblings are found at the top level and
inside ``scan`` bodies (layers under ``nn.scan``), row-wise uses at the top level. Equations
under other control flow (``cond``, ``while``, ``checkpoint`` written in the model), or in a
``jit`` with its own shardings, run as traced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.extend import source_info_util
from jax.sharding import PartitionSpec as P

from epljax.errors import PlanError
from epljax.sharding import dims as D
from epljax.sharding import split_rules
from epljax.sharding.program import (Program, Step, Steps, bind, bind_here, finish, in_context,
                                     read, run_body, run_steps, start_env, trace_steps)
from epljax.sharding.specs import spec_for


PLATFORMS = ("cpu",)   # where XLA lacks all-reduce reassociation (module doc)


@dataclasses.dataclass(frozen=True)
class _Column:
  """A column-split matmul: its weight is operand ``side``, split on its dim ``dim``."""
  side: int
  dim: int


@dataclasses.dataclass(frozen=True)
class _RowUse:
  """A row-wise use of parameter ``leaf`` (operand ``pos``, the parameter's dims in the order
  ``perm``: a transpose of it); the rows are dim ``rows`` of operand ``1 - pos`` and dim
  ``out`` of the output."""
  leaf: int
  pos: int
  perm: tuple[int, ...]
  rows: int
  out: int


def column_matmuls(program: Program, split: dict[int, int], leaf_shapes, leaf_paths,
                   devices: int) -> dict[int, _Column]:
  """Node index -> how it is a column-split matmul reading an unsplit activation.
  ``split`` maps parameter leaves (the first program inputs) to their ``model`` dimension."""
  if not split:
    return {}
  try:
    state = split_rules.operand_splits(program, split, leaf_shapes, leaf_paths, devices)
  except PlanError:
    return {}   # the plan was checked when it was made; this only looks for a speed-up
  found = {}
  for node in program.nodes:
    if node.primitive != "dot_general":
      continue
    _, _, free = D.dot_dims(node.eqn)
    for side in (0, 1):
      w = state.view(node, side)
      if w is None or w.leaf not in split or split[w.leaf] not in w.dims:
        continue
      dim = w.dims.index(split[w.leaf])
      other = 1 - side
      if (dim in free[side] and D.shape(node.eqn.invars[side])[dim] % devices == 0
          and state.view(node, other) is None and state.split_dim(node, other) is None):
        found[node.index] = _Column(side, dim)
  return found


def row_uses(program: Program, steps: Steps, rows_inputs: Sequence[int], replicas: int,
             leaf_shapes, leaf_paths) -> dict[int, _RowUse]:
  """Node index -> how it is a row-wise use of a parameter read by more than one (module
  doc): a lookup (``gather`` from the parameter itself) or a matmul with the parameter or its
  transpose, whose other operand keeps its rows; one of ``steps``, the program as evaluated
  (not in a loop, a branch or a ``jit`` with shardings of its own)."""
  state = split_rules.row_dims(program, rows_inputs, leaf_shapes, leaf_paths)
  uses: dict[int, dict[int, _RowUse]] = {}
  for step in steps.steps:
    if step.primitive not in ("gather", "dot_general"):
      continue
    node = program.nodes[step.nodes.start]
    eqn = node.eqn
    candidates = []
    if node.primitive == "gather":
      rows = state.split_dim(node, 1)
      batching = getattr(eqn.params["dimension_numbers"], "operand_batching_dims", ())
      out = (split_rules.gather_index_dims(eqn).get(rows)
             if rows is not None and not batching else None)
      candidates.append((0, rows, out))
    elif node.primitive == "dot_general":
      _, batch, free = D.dot_dims(eqn)
      for pos in (0, 1):
        rows = state.split_dim(node, 1 - pos)
        ok = rows is not None and rows in free[1 - pos] and not batch[pos]
        candidates.append((pos, rows, D.dot_out_dim(eqn, 1 - pos, rows) if ok else None))
    for pos, rows, out in candidates:
      found = _parameter_read(program, node, pos, len(leaf_shapes))
      if out is None or found is None or D.shape(eqn.invars[1 - pos])[rows] % replicas:
        continue
      leaf, perm = found
      uses.setdefault(leaf, {})[node.index] = _RowUse(leaf, pos, perm, rows, out)
  return {i: u for found in uses.values() if len(found) > 1 for i, u in found.items()}


def _parameter_read(program: Program, node, pos: int, num_params: int):
  """(leaf, permutation) when operand ``pos`` of ``node`` is parameter ``leaf`` itself or one
  ``transpose`` of it (no cast, slice or reshape on the way), else None."""
  params = {v: i for i, v in enumerate(program.invars[:num_params])}
  bases = node.inputs[pos]
  if len(bases) != 1:
    return None
  if bases[0] in params:
    return params[bases[0]], tuple(range(len(D.shape(bases[0]))))
  producer = program.producer.get(bases[0])
  if (producer is not None and producer.primitive == "transpose"
      and len(producer.inputs[0]) == 1 and producer.inputs[0][0] in params):
    return params[producer.inputs[0][0]], tuple(producer.eqn.params["permutation"])
  return None


def shared_reduction(fn, *, mesh: jax.sharding.Mesh, model: str, data: str,
                     split: dict[int, int], leaf_shapes: Sequence[tuple[int, ...]],
                     leaf_paths: Sequence[str], rows: bool = True):
  """The forward ``fn(params, model_state, batch, fstate)`` with sibling column matmuls and
  (with ``rows``) a parameter's row-wise uses fused (module doc). ``split``: parameter leaf ->
  its dimension split over ``model``."""
  stats = {"siblings": 0, "matmuls": 0, "shared": 0, "uses": 0}

  def rewritten(params, model_state, batch, fstate):
    steps, leaves = trace_steps(fn, params, (model_state, batch, fstate))
    program = Program(steps.jaxpr)
    n_p = steps.num_params
    n_s = len(jax.tree.leaves(model_state))
    shapes, paths = leaf_shapes[:n_p], leaf_paths[:n_p]
    batch_inputs = [n_p + n_s + i for i, x in enumerate(jax.tree.leaves(batch)) if x.ndim]
    try:
      columns = column_matmuls(program, split, shapes, paths, mesh.shape[model])
      uses = (row_uses(program, steps, batch_inputs, mesh.shape[data], shapes, paths)
              if rows and mesh.shape[data] > 1 else {})
    except Exception as e:  # noqa: BLE001 (a speed-up only: the plan line says it failed)
      stats["failed"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
      columns, uses = {}, {}
    if not (columns or uses):   # the program as traced, without tracing the model again
      return jax.tree.unflatten(steps.out_tree, jcore.jaxpr_as_fun(steps.jaxpr)(*leaves))
    run = _Run(columns, uses, mesh, model, data, leaves[:n_p])
    outs = run(steps, leaves)
    stats.update(siblings=run.groups, matmuls=run.fused, shared=len(run.copies),
                 uses=run.row_uses)
    return outs

  def describe() -> str:
    """The plan's line: what the traced step fused."""
    if stats.get("failed"):
      return not_fused(f"finding what to fuse failed: {stats['failed']}; please report it")
    parts = []
    if stats["siblings"]:
      parts.append(f"{stats['siblings']} activations read by {stats['matmuls']} column "
                   f"matmuls, one all-reduce over {model} each")
    if stats["shared"]:
      parts.append(f"{stats['shared']} parameters read by {stats['uses']} row-wise uses "
                   f"(tied), one reduction over {data} each")
    return "gradient sums: " + "; ".join(parts) if parts else ""

  rewritten.describe = describe
  return rewritten


def not_fused(why: str) -> str:
  """The plan's line when the step runs without the rewrite, and why."""
  return f"gradient sums: each partial sum all-reduced where made ({why})"


def _bind_inside(step: Step, operands: list, outside, **changes) -> Any:
  """Binds ``step`` inside a map, under its own name stack (``outside``: the name stack where
  the program runs); not its context, which holds the mesh outside the map."""
  if "out_sharding" in step.eqn.params:
    changes["out_sharding"] = None
  with source_info_util.user_context(step.eqn.source_info.traceback,
                                     name_stack=outside + step.name_stack):
    return bind_here(step.eqn, operands, **changes)[0]


def _mapped(step: Step, fn, *args, **map_args):
  """``jax.shard_map(fn, **map_args)(*args)`` as part of ``step`` (its name stack and context):
  gradient checkpointing finds the map in ``step``'s block."""
  return in_context(step, lambda: jax.shard_map(fn, **map_args)(*args))


class _Run:
  """Evaluates a program step by step with the fused forms (module doc)."""

  def __init__(self, columns: dict[int, _Column], rows: dict[int, _RowUse], mesh,
               model: str, data: str, params: Sequence[Any]):
    self.columns, self.rows, self.mesh, self.model, self.data = columns, rows, mesh, model, data
    self.params = params
    self.groups = self.fused = self.row_uses = 0   # per run of the program
    self.trips = 1            # iterations of the scans around the body being evaluated
    self.copies: dict[int, Any] = {}     # parameter leaf -> its (replicas, ...) varying copy

  def __call__(self, program: Steps, flat_args: Sequence[Any]) -> Any:
    """Runs ``program`` (its steps numbered by the capture's nodes) on ``flat_args``."""
    siblings = self._siblings(program)
    env = start_env(program, flat_args)
    ready: dict[int, list] = {}

    def rule(step: Step, invals: list) -> list:
      use = self.rows.get(step.nodes.start) if len(step.nodes) == 1 else None
      if step.index in ready:
        return ready.pop(step.index)
      if step.index in siblings:
        return self._columns(program, siblings[step.index], env, ready)
      if use is not None:
        return [self._row_use(step, use, invals)]
      if step.primitive == "scan" and any(n in step.nodes for n in self.columns):
        return in_context(step, run_body, step, invals, self._iteration(step))
      return bind(step, invals)

    run_steps(program.steps, env, rule)
    return finish(program, env)

  def _iteration(self, step: Step):
    """The scan ``step``'s body, run by this evaluation (its groups count once per
    iteration)."""
    length = step.eqn.params["length"]

    def run(body: Steps, flat: list) -> list:
      self.trips *= length
      try:
        return self(body, flat)
      finally:
        self.trips //= length

    return run

  # -- sibling column matmuls, over ``model`` --------------------------------------------
  def _siblings(self, program) -> dict[int, list[tuple[int, _Column]]]:
    """First step position -> the column matmuls (positions) that read its activation, each
    of whose weights exists by then."""
    defined_at = {k: pos for pos, s in enumerate(program.steps) for k in s.outputs}
    by_input: dict[Any, list[tuple[int, _Column]]] = {}
    for pos, step in enumerate(program.steps):
      member = self.columns.get(step.nodes.start)
      if member is None or len(step.nodes) != 1:
        continue
      x = step.inputs[1 - member.side]
      if isinstance(x, jcore.Literal):
        continue
      contract, batch, _ = D.dot_dims(step.eqn)
      key = (x, contract[1 - member.side], batch[1 - member.side])
      by_input.setdefault(key, []).append((pos, member))
    groups = {}
    for found in by_input.values():
      first = found[0][0]
      ready = [(pos, m) for pos, m in found
               if defined_at.get(program.steps[pos].inputs[m.side], -1) < first]
      if len(ready) > 1:
        groups[first] = ready
    return groups

  def _columns(self, program, group: list[tuple[int, _Column]], env: dict,
               ready: dict) -> list:
    """The group's matmuls in one map over ``model``; returns the first one's outputs and
    leaves the others' in ``ready``."""
    steps = [program.steps[pos] for pos, _ in group]
    members = [m for _, m in group]
    x = read(env, steps[0].inputs[1 - members[0].side])
    weights = [read(env, s.inputs[m.side]) for s, m in zip(steps, members)]
    axis = self.model

    outside = source_info_util.current_name_stack()

    def local(x, *ws):
      xv = jax.lax.pcast(x, axis, to="varying")   # one cast: its transpose is the all-reduce
      return [_bind_inside(s, [w, xv] if m.side == 0 else [xv, w], outside)
              for s, m, w in zip(steps, members, ws)]

    in_specs = (P(), *(spec_for(w.ndim, m.dim, axis) for w, m in zip(weights, members)))
    out_specs = [spec_for(len(D.shape(s.eqn.outvars[0])), D.dot_out_dim(s.eqn, m.side, m.dim), axis)
                 for s, m in zip(steps, members)]
    outs = _mapped(steps[0], local, x, *weights, mesh=self.mesh, in_specs=in_specs,
                   out_specs=out_specs, axis_names={axis})
    for (pos, _), out in zip(group[1:], outs[1:]):
      ready[pos] = [out]
    self.groups += self.trips
    self.fused += self.trips * len(group)
    return [outs[0]]

  # -- a parameter's row-wise uses, over ``data`` ------------------------------------------
  def _row_use(self, step: Step, use: _RowUse, invals: list) -> Any:
    """``step`` on each replica's rows, reading that replica's copy of the parameter."""
    axis = self.data
    if use.leaf not in self.copies:
      def copy(w):
        return jax.lax.pcast(w, axis, to="varying")[None]   # the transpose: one all-reduce
      self.copies[use.leaf] = _mapped(step, copy, self.params[use.leaf], mesh=self.mesh,
                                      in_specs=P(), out_specs=P(axis), axis_names={axis})
    other = invals[1 - use.pos]
    outside = source_info_util.current_name_stack()

    def local(w, x):
      w = jnp.transpose(w[0], use.perm)
      return _bind_inside(step, [w, x] if use.pos == 0 else [x, w], outside)

    self.row_uses += 1
    return _mapped(step, local, self.copies[use.leaf], other, mesh=self.mesh,
                   in_specs=(P(axis), spec_for(other.ndim, use.rows, axis)),
                   out_specs=spec_for(len(D.shape(step.eqn.outvars[0])), use.out, axis),
                   axis_names={axis})
