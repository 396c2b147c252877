"""Split rules: which dimension of each parameter a ``split`` task graph cuts, read from the
traced program (not from layer class names).

One pass over the program in trace order tracks, for every value, which of its dimensions is
split over the ``model`` axis, and decides each candidate parameter at its first decisive use:

- ``dot_general`` with a parameter operand (a weight):
  - a weight dimension used as a batch dimension -> split on it (**experts**: the leading
    experts dimension of an MoE weight, einsum ``egcd,edf->egcf``);
  - the activation already split on a contracting dimension -> split the weight on the matching
    contracting dimension (**row**, Megatron's second matmul: partial sums, one all-reduce);
  - else split the weight's first free dimension (**column**: output features; for attention
    projections ``(features, heads, head_dim)`` that is the heads).
- ``gather`` reading a parameter (an embedding lookup) -> split on the looked-up dimension
  (**vocabulary**).
- An elementwise use next to a split activation (a bias add, a norm's scale) -> split the
  parameter along with it (**follows** the weight that split the activation).

Values keep their split dimension through elementwise ops, broadcasts, reshapes that keep the
dimension whole, transposes and reductions over other dimensions; anything else is treated as
not split, which only makes GSPMD communicate more, never compute wrong numbers. A parameter
with no decisive use stays replicated. A decided dimension that does not divide by the device
count is an error naming the parameter, its shape and the count.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

from jax.sharding import PartitionSpec as P

from epljax.errors import PlanError
from epljax.sharding.program import Node, Program

COLUMN, ROW, EXPERTS, VOCAB, FOLLOWS = "column", "row", "experts", "vocabulary", "follows"


@dataclasses.dataclass(frozen=True)
class Decision:
  """Parameter leaf ``leaf`` is split on ``dim`` because of ``rule``."""
  leaf: int
  dim: int
  rule: str


@dataclasses.dataclass(frozen=True)
class _View:
  """A value that is a parameter seen through shape-only ops: view dim i is param dim map[i]."""
  leaf: int
  dims: tuple[int | None, ...]


def split_decisions(program: Program, candidates: Iterable[int], leaf_shapes: Sequence[tuple],
                    leaf_paths: Sequence[str], device_count: int,
                    fixed: Mapping[int, int] | None = None) -> dict[int, Decision]:
  """Decides the split dimension of each candidate variable leaf (program input index).

  ``fixed`` gives leaves whose split dimension the user already chose (their activations
  propagate like decided ones: a user-split first matmul makes the next one a row split).
  """
  fixed = dict(fixed or {})
  candidates = set(candidates) - set(fixed)
  state = _State(program, candidates | set(fixed), leaf_shapes)
  state.decisions.update({i: Decision(i, d, "user") for i, d in fixed.items()})
  for node in program.nodes:
    state.visit(node)
  state.decisions = {i: d for i, d in state.decisions.items() if i in candidates}
  for d in state.decisions.values():
    size = leaf_shapes[d.leaf][d.dim]
    if size % device_count:
      raise PlanError(
          f"Parameter '{leaf_paths[d.leaf]}' (shape {tuple(leaf_shapes[d.leaf])}) is split "
          f"({d.rule}) on dimension {d.dim} of size {size}, which does not divide into "
          f"{device_count} devices. Use a device count that divides {size}, change the "
          "layer's size, or give the parameter an explicit PartitionSpec with epl.annotate.")
  return state.decisions


class _State:

  def __init__(self, program: Program, candidates: set[int], leaf_shapes: Sequence[tuple]):
    self.program = program
    self.decisions: dict[int, Decision] = {}
    self.split: dict[object, int] = {}             # value -> split dim
    self.views: dict[object, _View] = {}           # value -> parameter view
    self.candidates = candidates
    for i, var in enumerate(program.invars):
      if i in candidates:
        self.views[var] = _View(i, tuple(range(len(leaf_shapes[i]))))
    self.leaf_shapes = leaf_shapes

  # -- reading operands -----------------------------------------------------------------
  def _bases(self, node: Node, pos: int):
    return node.inputs[pos]

  def view(self, node: Node, pos: int) -> _View | None:
    for b in self._bases(node, pos):
      v = self.views.get(b)
      if v is not None:
        return _align(v, _shape(node.eqn.invars[pos]), self.leaf_shapes[v.leaf])
    return None

  def split_dim(self, node: Node, pos: int) -> int | None:
    """The split dim of operand ``pos`` (a decided parameter view counts as split)."""
    for b in self._bases(node, pos):
      if b in self.split:
        return self.split[b]
    v = self.view(node, pos)
    if v is not None and v.leaf in self.decisions:
      dim = self.decisions[v.leaf].dim
      return v.dims.index(dim) if dim in v.dims else None
    return None

  def decide(self, v: _View, view_dim: int, rule: str) -> None:
    if v.leaf in self.decisions or v.leaf not in self.candidates:
      return
    param_dim = v.dims[view_dim]
    if param_dim is not None:
      self.decisions[v.leaf] = Decision(v.leaf, param_dim, rule)

  def set_out(self, node: Node, dim: int | None, idx: int = 0) -> None:
    if dim is not None and idx < len(node.eqn.outvars):
      self.split[node.eqn.outvars[idx]] = dim

  # -- the rules ----------------------------------------------------------------------------
  def visit(self, node: Node) -> None:
    prim = node.primitive
    eqn = node.eqn
    if prim == "dot_general":
      self._dot(node)
    elif prim == "gather":
      self._gather(node)
    elif prim in ("broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims",
                  "convert_element_type", "copy", "copy_p"):
      self._shape_op(node)
    elif prim.startswith("reduce_") or prim in ("argmax", "argmin"):
      dim = self.split_dim(node, 0)
      axes = tuple(eqn.params.get("axes", ()))
      if dim is not None and dim not in axes:
        self.set_out(node, dim - sum(a < dim for a in axes))
    elif _elementwise(eqn):
      self._elementwise(node)

  def _dot(self, node: Node) -> None:
    (lc, rc), (lb, rb) = node.eqn.params["dimension_numbers"]
    nd = (len(_shape(node.eqn.invars[0])), len(_shape(node.eqn.invars[1])))
    views = (self.view(node, 0), self.view(node, 1))
    contract, batch = (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))
    free = tuple(tuple(d for d in range(nd[s]) if d not in contract[s] and d not in batch[s])
                 for s in range(2))
    for side in (0, 1):
      w, other = views[side], 1 - side
      if w is None or w.leaf not in self.candidates or w.leaf in self.decisions:
        continue
      if views[other] is not None and views[other].leaf not in self.decisions:
        continue  # two undecided parameters: nothing tells which to split
      act = self.split_dim(node, other)
      if batch[side] and any(w.dims[d] is not None for d in batch[side]):
        d = next(d for d in batch[side] if w.dims[d] is not None)
        self.decide(w, d, EXPERTS)
      elif act is not None and act in contract[other]:
        self.decide(w, contract[side][contract[other].index(act)], ROW)
      elif free[side]:
        d = next((d for d in free[side] if w.dims[d] is not None), None)
        if d is not None:
          self.decide(w, d, COLUMN)
    # Where the output is split: the first split operand dim that survives.
    for side in (0, 1):
      dim = self.split_dim(node, side)
      if dim is None or dim in contract[side]:
        continue
      if dim in batch[side]:
        self.set_out(node, batch[side].index(dim))
      else:
        offset = len(batch[0]) + (0 if side == 0 else len(free[0]))
        self.set_out(node, offset + free[side].index(dim))
      return

  def _gather(self, node: Node) -> None:
    w = self.view(node, 0)
    if w is None:
      return
    dnums = node.eqn.params["dimension_numbers"]
    indexed = tuple(getattr(dnums, "start_index_map", ()))
    if len(indexed) == 1:
      self.decide(w, indexed[0], VOCAB)

  def _shape_op(self, node: Node) -> None:
    eqn = node.eqn
    in_shape, out_shape = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    mapping = _dim_map(eqn.primitive.name, eqn.params, in_shape, out_shape)
    if mapping is None:
      return
    dim = self.split_dim(node, 0)
    if dim is not None and mapping.get(dim) is not None:
      self.set_out(node, mapping[dim])
    v = self.view(node, 0)
    if v is not None:
      inverse = {o: i for i, o in mapping.items() if o is not None}
      self.views[eqn.outvars[0]] = _View(
          v.leaf, tuple(v.dims[inverse[j]] if j in inverse else None
                        for j in range(len(out_shape))))

  def _elementwise(self, node: Node) -> None:
    eqn = node.eqn
    out_shape = _shape(eqn.outvars[0])
    dim = None
    for pos in range(len(eqn.invars)):
      d = self.split_dim(node, pos)
      if d is not None and _shape(eqn.invars[pos])[d] == out_shape[d]:
        dim = d
        break
    if dim is None:
      return
    self.set_out(node, dim)
    for pos in range(len(eqn.invars)):
      v = self.view(node, pos)
      shape = _shape(eqn.invars[pos])
      if v is not None and len(shape) == len(out_shape) and shape[dim] == out_shape[dim]:
        self.decide(v, dim, FOLLOWS)


def _shape(v) -> tuple[int, ...]:
  return tuple(getattr(getattr(v, "aval", None), "shape", ()))


def _elementwise(eqn) -> bool:
  """Same-rank operands whose dims equal the output's or are 1 (jaxpr's broadcasting)."""
  out = _shape(eqn.outvars[0]) if len(eqn.outvars) == 1 else None
  if not out:
    return False
  for v in eqn.invars:
    s = _shape(v)
    if s and (len(s) != len(out) or any(a not in (b, 1) for a, b in zip(s, out))):
      return False
  return True


def _align(v: _View, shape: tuple[int, ...], leaf_shape: tuple[int, ...]) -> _View:
  """A parameter read with fewer leading dims (the per-layer slice of a scanned stack)."""
  if len(shape) < len(v.dims) and tuple(leaf_shape[len(leaf_shape) - len(shape):]) == shape:
    return _View(v.leaf, v.dims[len(v.dims) - len(shape):])
  return v


def _dim_map(prim: str, params, in_shape, out_shape) -> dict[int, int | None] | None:
  """Input dim -> output dim for shape-only ops (None: the dim does not survive whole)."""
  if prim in ("convert_element_type", "copy", "copy_p"):
    return {i: i for i in range(len(in_shape))}
  if prim == "transpose":
    perm = tuple(params["permutation"])
    return {src: dst for dst, src in enumerate(perm)}
  if prim == "broadcast_in_dim":
    dims = tuple(params["broadcast_dimensions"])
    return {i: (d if in_shape[i] == out_shape[d] else None) for i, d in enumerate(dims)}
  if prim == "squeeze":
    dropped = set(params["dimensions"])
    kept = [i for i in range(len(in_shape)) if i not in dropped]
    return {i: (kept.index(i) if i in kept else None) for i in range(len(in_shape))}
  if prim in ("reshape", "expand_dims"):
    return _reshape_map(in_shape, out_shape)
  return None


def _reshape_map(a: tuple[int, ...], b: tuple[int, ...]) -> dict[int, int | None]:
  """Maps dims of ``a`` to dims of ``b`` for a reshape: a dim maps when it survives whole, or
  is the major factor of a merged dim, or splits with its size kept in the first part."""
  out: dict[int, int | None] = {i: None for i in range(len(a))}
  i = j = 0
  while i < len(a) and j < len(b):
    if a[i] == 1 and (j >= len(b) or b[j] != 1):
      i += 1
      continue
    if b[j] == 1 and a[i] != 1:
      j += 1
      continue
    # Group a[i:i2] with b[j:j2] of equal product.
    i2, j2, pa, pb = i + 1, j + 1, a[i], b[j]
    while pa != pb:
      if pa < pb:
        pa *= a[i2]
        i2 += 1
      else:
        pb *= b[j2]
        j2 += 1
    if i2 - i == 1 and j2 - j == 1:
      out[i] = j
    elif i2 - i > 1 and j2 - j == 1:
      out[i] = j                      # merged: the major input dim keeps the split
    elif i2 - i == 1 and j2 - j > 1 and math.gcd(b[j], a[i]) == b[j]:
      out[i] = j                      # split: the major output dim keeps it
    i, j = i2, j2
  return out


def spec_for(ndim: int, dim: int | None, axis: str) -> P:
  """The PartitionSpec splitting ``dim`` over ``axis`` (replicated when ``dim`` is None)."""
  if dim is None:
    return P()
  return P(*[axis if i == dim else None for i in range(ndim)])
