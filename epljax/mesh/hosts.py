"""Which mesh axes a group of devices runs over, and whether it crosses hosts.

The one answer to "does this collective leave the host?", for the plan search's estimates
(``estimate``), the costs of a compiled step (``cost``) and the plan's printout. A host is a
process: devices are on the same host when their ``process_index`` is the same (one process per
host, as the launcher starts them; compile-only devices of ``epl.topology`` carry the host they
stand for).

>>> axes_of([[0, 1]], mesh)            # doctest: +SKIP
('model',)
>>> crosses_hosts(mesh, ("data",))     # doctest: +SKIP
True
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jax.sharding import Mesh


def axis_groups(devices: np.ndarray, axis_names: Sequence[str],
                axes: Sequence[str]) -> np.ndarray:
  """The groups a collective over ``axes`` runs in: one row per group, the devices that vary
  along ``axes`` with the other axes fixed (``devices``: the mesh's device grid)."""
  inside = [list(axis_names).index(a) for a in axes]
  outside = [d for d in range(devices.ndim) if d not in inside]
  size = int(np.prod([devices.shape[d] for d in inside], dtype=int))
  return devices.transpose(outside + inside).reshape(-1, size)


def groups_cross_hosts(groups: Sequence[Sequence[object]]) -> bool:
  """Whether any group holds devices of more than one host (process)."""
  return any(len({d.process_index for d in group}) > 1 for group in groups)


def crosses_hosts(mesh: Mesh, axes: Sequence[str] | str) -> bool:
  """Whether a collective over ``axes`` (a name, or names) of ``mesh`` crosses hosts: some
  group of devices along them spans two processes. Whatever the axes' order in the mesh."""
  if isinstance(axes, str):
    axes = [a for a in axes.split("+") if a]
  axes = [a for a in axes if a in mesh.shape and mesh.shape[a] > 1]
  if not axes:
    return False
  return groups_cross_hosts(axis_groups(mesh.devices, mesh.axis_names, axes))


def axes_of(groups: Sequence[Sequence[int]], mesh: Mesh) -> tuple[str, ...] | None:
  """The mesh axes whose devices the groups (device ids) span, in mesh order: the axes along
  which the first group's devices differ, provided every group is such a line of the mesh
  (``axis_groups`` over those axes gives the same groups). None when the groups are not
  aligned with the mesh's axes (or name devices outside it)."""
  ids = np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices)
  where = {int(i): np.argwhere(ids == i)[0] for i in ids.flat}
  if not groups or any(d not in where for g in groups for d in g):
    return None
  first = np.array([where[d] for d in groups[0]])
  axes = tuple(name for i, name in enumerate(mesh.axis_names)
               if len(set(first[:, i].tolist())) > 1)
  expected = {frozenset(row.tolist()) for row in axis_groups(ids, mesh.axis_names, axes)}
  if axes and {frozenset(g) for g in groups} != expected:
    return None
  return axes


def describe(groups: Sequence[Sequence[int]], mesh: Mesh) -> tuple[str, int, bool]:
  """(the axes a collective's groups span, ``"data"`` or ``"data+model"``, ``"-"`` for none,
  ``"?"`` when they are not the mesh's lines; its group size; whether a group crosses hosts).
  The host answer reads the groups themselves, so it holds for unaligned groups too."""
  by_id = {d.id: d for d in mesh.devices.flat}
  axes = axes_of(groups, mesh)
  size = len(groups[0]) if groups else 1
  across = groups_cross_hosts([[by_id[d] for d in g if d in by_id] for g in groups])
  name = "?" if axes is None else "+".join(axes) or "-"
  return name, size, across
