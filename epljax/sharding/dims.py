"""How one split dimension of a value travels through a single equation (shape-only ops,
elementwise ops, slices, reductions): the pieces the split rules reason with."""

from __future__ import annotations

import dataclasses
import math

SHAPE_OPS = ("broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims",
             "convert_element_type", "copy", "copy_p", "reduce_precision")


@dataclasses.dataclass(frozen=True)
class View:
  """A value that is a parameter seen through shape-only ops: view dim i is param dim dims[i]."""
  leaf: int
  dims: tuple[int | None, ...]


def shape(v) -> tuple[int, ...]:
  return tuple(getattr(getattr(v, "aval", None), "shape", ()))


def is_elementwise(eqn) -> bool:
  """Same-rank operands whose dims equal the output's or are 1 (jaxpr's broadcasting)."""
  out = shape(eqn.outvars[0]) if len(eqn.outvars) == 1 else None
  if not out:
    return False
  for v in eqn.invars:
    s = shape(v)
    if s and (len(s) != len(out) or any(a not in (b, 1) for a, b in zip(s, out))):
      return False
  return True


def rows_only(eqn) -> bool:
  """A ``slice`` that keeps every dimension but the first whole, without strides."""
  start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
  strides = eqn.params.get("strides")
  full = shape(eqn.invars[0])
  return (all(s == 0 for s in start[1:]) and tuple(limit[1:]) == tuple(full[1:])
          and (strides is None or all(st == 1 for st in strides)))


def align(v: View, value_shape: tuple[int, ...], leaf_shape: tuple[int, ...]) -> View:
  """A parameter read with fewer leading dims (the per-layer slice of a scanned stack)."""
  if (len(value_shape) < len(v.dims)
      and tuple(leaf_shape[len(leaf_shape) - len(value_shape):]) == value_shape):
    return View(v.leaf, v.dims[len(v.dims) - len(value_shape):])
  return v


def passes(eqn, dim: int) -> int | None | bool:
  """Where the split ``dim`` of operand 0 (any operand of a concatenate) lands in the output of
  a structural op: the output dim, None when the dimension does not survive whole (sliced,
  merged as the minor factor, squeezed, reduced over), False when the op is not structural."""
  prim = eqn.primitive.name
  in_shape, out_shape = shape(eqn.invars[0]), shape(eqn.outvars[0])
  if prim in SHAPE_OPS:
    mapping = dim_map(prim, eqn.params, in_shape, out_shape)
    return None if mapping is None else mapping.get(dim)
  if prim == "concatenate":
    return None if dim == eqn.params["dimension"] else dim
  if prim == "pad":
    low, high, interior = zip(*eqn.params["padding_config"])
    return dim if (low[dim], high[dim], interior[dim]) == (0, 0, 0) else None
  if prim in ("slice", "dynamic_slice"):
    return dim if len(out_shape) == len(in_shape) and out_shape[dim] == in_shape[dim] else None
  if prim.startswith("reduce_") or prim in ("argmax", "argmin"):
    axes = tuple(eqn.params.get("axes", ()))
    return None if dim in axes else dim - sum(a < dim for a in axes)
  return False


def dim_map(prim: str, params, in_shape, out_shape) -> dict[int, int | None] | None:
  """Input dim -> output dim for shape-only ops (None: the dim does not survive whole)."""
  if prim in ("convert_element_type", "copy", "copy_p", "reduce_precision"):
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
    return reshape_map(in_shape, out_shape)
  return None


def reshape_map(a: tuple[int, ...], b: tuple[int, ...]) -> dict[int, int | None]:
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


def dot_dims(eqn):
  """(contract, batch, free) per operand of a dot_general, and each operand's first output dim
  for its free dims."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  nd = (len(shape(eqn.invars[0])), len(shape(eqn.invars[1])))
  contract, batch = (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))
  free = tuple(tuple(d for d in range(nd[s]) if d not in contract[s] and d not in batch[s])
               for s in range(2))
  return contract, batch, free


def dot_out_dim(eqn, side: int, dim: int) -> int | None:
  """The output dim operand ``side``'s dim ``dim`` becomes (None when contracted)."""
  contract, batch, free = dot_dims(eqn)
  if dim in contract[side]:
    return None
  if dim in batch[side]:
    return batch[side].index(dim)
  offset = len(batch[0]) + (0 if side == 0 else len(free[0]))
  return offset + free[side].index(dim)


def pieces_dim(eqn, dim: int) -> int:
  """Where ``dim`` lands in each piece of a ``split`` (same rank) or ``unstack`` (the axis
  dropped)."""
  if eqn.primitive.name == "unstack" and dim > eqn.params["axis"]:
    return dim - 1
  return dim


def data_values(program, num_variables: int) -> set:
  """Values computed from the batch (program inputs after the variables)."""
  data = set(program.invars[num_variables:])
  for node in program.nodes:
    if any(b in data for bases in node.inputs for b in bases):
      data.update(node.eqn.outvars)
  return data
