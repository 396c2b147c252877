"""Fused parameters held part by part: a column-split matmul whose output is cut into equal parts.

Hugging Face's GPT-2 and nanoGPT compute q, k and v with one ``c_attn`` matmul (kernel
``(C, 3C)``, or ``(3C, C)`` read transposed) and split its output in three; a gated MLP may
fuse gate and up the same way. Megatron splits each *part* by heads (hidden units): device
``d`` needs the d-th shard of q, of k and of v. A ``PartitionSpec`` cuts the fused dimension
into contiguous blocks instead (device 0: all of q and half of k), and GSPMD then moves the
activations between devices at every layer.

So a fused leaf (``split_rules.Decision.parts`` > 1) is *stored* with its fused dimension
reordered device-major: for ``k`` parts of size ``n`` over ``m`` devices, stored position
``(d, j, i)`` holds the user's ``(j, d, i)`` (part ``j``, shard ``d``, offset ``i < n / m``).
The array keeps the user's shape and spec (``P(..., 'model', ...)``), so device ``d``'s
contiguous block is exactly its shard of every part; the optimizer's state mirrors it (any
optimizer whose update does not depend on the order of a dimension, which holds for every
elementwise one and for factored or orthogonalizing ones, updates it identically).

The loss reads the stored order through ``loss_call``: the traced program is re-run step by
step (``program.trace_steps``/``run_steps``), following each stored-order value through
transposes, reshapes, casts, elementwise ops (the bias, stored the same way) and the matmul,
to the ``split`` into its parts, which is evaluated as a reshape to ``(m, k, n / m)`` and one
index per part: local on each device, each part then split by heads. Any other use of a
stored-order value is an error (``FusedLayoutError``). ``to_user`` / ``to_internal`` convert
at the boundary (``Trainer.variables``, checkpoints, the init).

Why store it reordered rather than rewrite only the matmul: a rewrite alone would read the
user's contiguous blocks and move weights instead of activations; a ``(C, 3, C)`` storage
would change the shape optimizers, masks and checkpoints see. A reorder changes neither.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.extend import core as jcore

from epljax.errors import PlanError
from epljax.sharding import dims as D
from epljax.sharding.program import (REMAT, Step, bind, evaluate, in_context, inner_eqns,
                                     run_body, trace_steps)


class FusedLayoutError(PlanError):
  """A fused parameter stored part by part is used in a way its stored order cannot follow."""


_CANNOT_FOLLOW = """\
Parameter '{path}' (shape {shape}) is a fusion of {k} equal parts on its dimension {dim} (its
output is split in {k} along it, like GPT-2's fused q/k/v), so a split({m}) task graph stores it
with device d holding the d-th shard of every part. Its value reaches equation {where}, which
{why}. Split the fused output with jnp.split right after the matmul (and its bias), or give the
parameter an explicit spec with epl.annotate({{'{path}': P(...)}}) to split it as one block."""


@dataclasses.dataclass(frozen=True)
class Fused:
  """Leaf ``leaf`` is ``parts`` equal parts on ``dim``, each split over ``devices``."""
  leaf: int
  dim: int
  parts: int
  devices: int
  path: str
  shape: tuple[int, ...]

  def reorder(self, x: Any, to_internal: bool, dim: int | None = None) -> Any:
    """``x``'s dimension ``dim`` (default: the leaf's) from the user's order to the stored
    one, or back."""
    dim = self.dim if dim is None else dim
    k, m = self.parts, self.devices
    n = x.shape[dim] // k
    first, second = (k, m) if to_internal else (m, k)
    y = x.reshape(x.shape[:dim] + (first, second, n // m) + x.shape[dim + 1:])
    y = jax.numpy.swapaxes(y, dim, dim + 1)
    return y.reshape(x.shape)


@dataclasses.dataclass(frozen=True)
class _Stored:
  """A value whose dimension ``dim`` is in the stored order of ``fused``."""
  fused: Fused
  dim: int


class FusedLayouts:
  """Every fused parameter leaf of a trainer (module doc)."""

  def __init__(self, fused: Mapping[int, Fused], num_params: int):
    self.fused = dict(fused)
    self.num_params = num_params

  @classmethod
  def of(cls, parts: Sequence[tuple[int, int]], paths: Sequence[str],
         shapes: Sequence[tuple[int, ...]], devices: int, num_params: int) -> FusedLayouts:
    """From ``(dim, parts)`` per leaf (``parts`` 1: not fused) of the first ``num_params``."""
    return cls({i: Fused(i, dim, k, devices, paths[i], tuple(shapes[i]))
                for i, (dim, k) in enumerate(parts[:num_params])
                if k > 1 and devices > 1}, num_params)

  def __bool__(self) -> bool:
    return bool(self.fused)

  def describe(self) -> str:
    if not self.fused:
      return ""
    return (f"fused parameters: {len(self.fused)} stored with device d's shard of each part "
            "together (" + ", ".join(sorted({f"{f.parts} parts" for f in self.fused.values()}))
            + "); Trainer.variables and checkpoints hold the user's order")

  # -- the boundary -----------------------------------------------------------------------
  def _params(self, params: Any, to_internal: bool) -> Any:
    if not self.fused:
      return params
    leaves, tree = jax.tree.flatten(params)
    leaves = [self.fused[i].reorder(x, to_internal) if i in self.fused else x
              for i, x in enumerate(leaves)]
    return jax.tree.unflatten(tree, leaves)

  def to_internal(self, params: Any) -> Any:
    return self._params(params, True)

  def to_user(self, params: Any) -> Any:
    return self._params(params, False)

  def opt_state(self, optimizer, opt_state: Any, params_like: Any, to_internal: bool) -> Any:
    """The optimizer state's parameter-shaped parts reordered like the parameters."""
    if not self.fused:
      return opt_state
    from epljax.step import map_optimizer_state   # step imports the sharding package
    index = jax.tree.unflatten(jax.tree.structure(params_like),
                               range(len(jax.tree.leaves(params_like))))

    def one(v, i):
      f = self.fused.get(i)
      return v if f is None or not hasattr(v, "shape") else f.reorder(v, to_internal)

    return map_optimizer_state(optimizer, one, opt_state, index)

  # -- the loss on stored-order parameters -----------------------------------------------
  def loss_call(self, loss_call: Callable) -> Callable:
    """``loss_call(params, model_state, batch)`` on parameters in the stored order."""
    if not self.fused:
      return loss_call

    def stored_order(params, model_state, batch):
      program, flat = trace_steps(loss_call, params, (model_state, batch))
      stored = {program.param_keys[i]: _Stored(f, f.dim) for i, f in self.fused.items()}
      return evaluate(program, flat, lambda step, invals: _run(step, invals, stored))

    return stored_order


def _run(step: Step, invals: list, stored: dict) -> list:
  """``step`` on its values, following the stored order (module doc)."""
  marked = {pos: stored[a] for pos, a in enumerate(step.inputs)
            if not isinstance(a, jcore.Literal) and a in stored}
  if not marked:
    return bind(step, invals)
  eqn, prim = step.eqn, step.primitive
  pos, s = next(iter(marked.items()))
  f = s.fused
  out_shape = D.shape(eqn.outvars[0])

  def fail(why: str):
    where = f"{step.index} ({prim} in {'/'.join(step.frames) or 'the top level'})"
    raise FusedLayoutError(_CANNOT_FOLLOW.format(path=f.path, shape=f.shape, k=f.parts,
                                                 dim=f.dim, m=f.devices, where=where, why=why))

  def mark(dims: Sequence[int | None], outs: list) -> list:
    for key, d in zip(step.outputs, dims):
      if key is not None and d is not None:
        stored[key] = _Stored(f, d)
    return outs

  if any((m.fused.parts, m.fused.devices) != (f.parts, f.devices) for m in marked.values()):
    fail("mixes it with a fusion of other parts")
  if prim in REMAT:   # nn.remat / jax.checkpoint written in the model: its body, rematerialized
    return in_context(step, _remat, step, invals, marked, stored)
  if prim == "split" and eqn.params["axis"] == s.dim and len(marked) == 1:
    sizes = eqn.params["sizes"]
    if len(sizes) != f.parts or len(set(sizes)) != 1:
      fail(f"cuts it into {len(sizes)} pieces of sizes {tuple(sizes)}, not its {f.parts} parts")
    return in_context(step, _parts, invals[0], f, s.dim)
  if prim == "split":
    return mark([s.dim] * len(eqn.outvars), bind(step, invals))
  if prim in D.SHAPE_OPS:
    mapping = D.dim_map(prim, eqn.params, D.shape(eqn.invars[0]), out_shape) or {}
    d = mapping.get(s.dim)
    if d is None or out_shape[d] != D.shape(eqn.invars[0])[s.dim]:
      fail("does not keep that dimension whole")
    return mark([d], bind(step, invals))
  if prim == "dot_general":
    contract, batch, free = D.dot_dims(eqn)
    if len(marked) == 1 and s.dim in free[pos]:
      return mark([D.dot_out_dim(eqn, pos, s.dim)], bind(step, invals))
    if (len(marked) == 2 and marked[0].dim in contract[0]
        and contract[1][contract[0].index(marked[0].dim)] == marked[1].dim):
      return bind(step, invals)   # a sum over the dimension: any order gives it
    fail("contracts it against a value in the user's order")
  if _pointwise(eqn):
    for p, v in enumerate(eqn.invars):
      shape = D.shape(v)
      if shape and shape[s.dim] == out_shape[s.dim] > 1 and (
          p not in marked or marked[p].dim != s.dim):
        fail("combines it with a value in the user's order")
    return mark([s.dim], bind(step, invals))
  fail("is not a transpose, reshape, cast, elementwise op, matmul, split or checkpoint (a "
       "scan, loop, branch or custom derivative cannot hold it yet)")


def _pointwise(eqn) -> bool:
  """Elementwise in fact, not only in shape: no axis to run along (a cumulative sum, a
  reverse, a sort keep the shape but mix positions), and so is every equation inside."""
  if any(k in eqn.params for k in ("axis", "axes", "dimension", "dimensions")):
    return False
  return D.is_elementwise(eqn) and all(_pointwise(e) for e in inner_eqns(eqn))


def _remat(step: Step, invals: list, marked: dict, stored: dict) -> list:
  """A ``checkpoint`` equation re-bound as ``jax.checkpoint`` of its body, run by ``_run``."""
  found: dict[int, _Stored] = {}

  def inner(body, args):
    inside = {body.inputs[pos]: m for pos, m in marked.items()}
    outs = evaluate(body, args, lambda s, vals: _run(s, vals, inside))
    found.update((i, inside[a]) for i, a in enumerate(body.outputs)
                 if not isinstance(a, jcore.Literal) and a in inside)
    return outs

  outs = run_body(step, invals, inner)
  for i, m in found.items():
    if step.outputs[i] is not None:
      stored[step.outputs[i]] = m
  return outs


def _parts(x, f: Fused, dim: int) -> list:
  """The ``f.parts`` parts of stored-order ``x`` along ``dim``, each in the user's order:
  ``(m, k, n / m)`` and one index per part (each device keeps its own shard of each)."""
  k, m = f.parts, f.devices
  n = x.shape[dim] // k
  y = jax.lax.reshape(x, x.shape[:dim] + (m, k, n // m) + x.shape[dim + 1:])
  shape = x.shape[:dim] + (n,) + x.shape[dim + 1:]
  return [jax.lax.reshape(jax.lax.index_in_dim(y, j, dim + 1, keepdims=False), shape)
          for j in range(k)]
