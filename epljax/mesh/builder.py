"""EPL's placement rules, turned into one ``jax.sharding.Mesh``.

- Task graphs that are not colocated are placed on different devices, one after the other: a
  replica needs the *sum* of their device counts, and they are pipeline stages (EPL).
- With ``cluster.colocate_split_and_replicate`` they share devices: a replica needs their
  (common) device count.
- Every device left over makes more replicas: nested data parallelism, ``replicas = devices /
  devices per replica``.

Axis order is (data, stage, model), model innermost: with ``cluster.device_place_prefer_intra_node``
the devices of one replica are consecutive in host order, so tensor-parallel traffic (the
``model`` axis, the most frequent) stays inside a host and only gradient reduction crosses hosts.

Context parallelism (``context.parallel_degree = k > 1``) adds an axis ``context`` of size k
between ``stage`` and ``model``: ``(data, stage, context, model)``. Every replica then holds k
times its devices, each with 1/k of every sequence. The attention's key/value exchange (a ring
of ``ppermute``s or an all-gather, every layer, forward and backward) is the most frequent
traffic after tensor parallelism's, so it sits next to ``model``: with
``cluster.device_place_prefer_intra_node`` one replica's context x model devices are
consecutive and stay inside a host while they fit in one; data parallelism's gradient
reduction (once a step) is what crosses hosts. Without context parallelism the mesh has no
``context`` axis.

Hybrid sharding (``zero.shard_size``, HSDP): GSPMD shards over whole mesh axes only, so ZeRO
over groups of the data replicas splits the data axis in two, ``(replica, data, stage,
model)``: ``data`` inside a group (what ZeRO shards over), ``replica`` across groups (plain
data parallelism), the batch split over both. Groups are consecutive devices, so a group of
one host's devices keeps ZeRO's gathers inside the host. Without hybrid sharding the mesh has
no ``replica`` axis.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from epljax.config import ClusterConfig
from epljax.errors import PlanError
from epljax.strategy import TaskGraph

DATA, STAGE, MODEL = "data", "stage", "model"
AXES = (DATA, STAGE, MODEL)
REPLICA = "replica"   # across the groups of hybrid sharding (zero.shard_size); see above
HYBRID_AXES = (REPLICA, *AXES)
CONTEXT = "context"   # the sequence split over devices (context.parallel_degree); see above
# GSPMD decides every intermediate sharding (Auto). jax 0.11 makes a bare AbstractMesh
# Explicit, where Flax's logical-axis constraints become assertions: always say Auto.
_AUTO = (AxisType.Auto,) * len(AXES)


def abstract_mesh(sizes: Sequence[int] = (1,) * len(AXES)) -> AbstractMesh:
  """An abstract (data, stage, model) mesh with GSPMD-decided (Auto) axes, on every jax."""
  return AbstractMesh(tuple(sizes), AXES, axis_types=_AUTO)


def data_axes(mesh) -> tuple[str, ...]:
  """The mesh axes of data parallelism, outermost first: ``(replica, data)`` under hybrid
  sharding, else ``(data,)``. What splits the batch and reduces the gradients."""
  return (REPLICA, DATA) if REPLICA in mesh.axis_names else (DATA,)


@dataclasses.dataclass(frozen=True)
class Layout:
  """The mesh and what each axis means for this model."""
  mesh: Mesh
  num_replicas: int
  num_stages: int
  devices_per_stage: int
  stage_of: tuple[int, ...]        # per task graph: its pipeline stage (0 when colocated);
                                   # its chunk with virtual stages, on stage chunk % num_stages
  colocated: bool
  num_virtual_stages: int = 1
  context: int = 1                 # devices each sequence is split over (the ``context`` axis)

  @property
  def num_groups(self) -> int:
    """Hybrid sharding's groups (the ``replica`` axis); 1 without it."""
    return dict(self.mesh.shape).get(REPLICA, 1)

  @property
  def devices_per_replica(self) -> int:
    """The devices of one model replica's stages; the ``context`` axis multiplies them."""
    return self.num_stages * self.devices_per_stage


def build_mesh(taskgraphs: Sequence[TaskGraph], devices: Sequence[jax.Device],
               cluster: ClusterConfig, virtual_stages: int = 1,
               shard_size: int | str = "all", context: int = 1) -> Layout:
  """Task graphs + devices -> ``Layout`` (see the module doc for the rules). With
  ``virtual_stages = v > 1`` the task graphs are pipeline chunks, ``v`` per stage;
  ``shard_size`` (``zero.shard_size``): the data replicas of one hybrid-sharding group;
  ``context`` (``context.parallel_degree``): devices each sequence is split over."""
  counts = [tg.device_count for tg in taskgraphs]
  colocated = cluster.colocate_split_and_replicate or len(taskgraphs) == 1
  _check_virtual(taskgraphs, virtual_stages, colocated)
  if len(set(counts)) > 1:
    what = ("colocated task graphs share their devices" if colocated else
            "task graphs that are not colocated are pipeline stages, and every stage")
    raise PlanError(
        f"Task graphs {_listing(taskgraphs)} use different device counts, but {what} must "
        f"use the same number of devices. Give them the same device_count"
        + ("" if colocated else ", or set cluster.colocate_split_and_replicate=True to put "
           "them on the same devices") + ".")
  per_stage = counts[0]
  stages = 1 if colocated else len(taskgraphs) // virtual_stages
  per_replica = per_stage * stages * context
  total = len(devices)
  how = (f"{_listing(taskgraphs)}" if colocated or len(taskgraphs) == 1 else
         f"the sum over the stages {_listing(taskgraphs)}")
  if context > 1:
    how += f", times context.parallel_degree={context}"
  if per_replica > total:
    raise PlanError(f"One model replica needs {per_replica} devices ({how}) but only {total} "
                    f"devices are available. Lower the device_count of the scopes or run on "
                    f"at least {per_replica} devices.")
  if total % per_replica:
    raise PlanError(f"One model replica needs {per_replica} devices ({how}), and {total} "
                    f"devices do not divide into replicas of {per_replica}. Use device counts "
                    f"whose replica size divides {total}, or run on a multiple of "
                    f"{per_replica} devices.")
  replicas = total // per_replica
  if context > 1 and stages > 1:
    raise PlanError(
        f"context.parallel_degree={context} splits sequences over a 'context' axis, which "
        f"epljax does not combine with pipeline stages ({stages} here: {_listing(taskgraphs)}) "
        "yet. Set context.parallel_degree=1, or run the model without pipeline stages (one "
        "task graph, or cluster.colocate_split_and_replicate=True) and use context x model x "
        "data parallelism.")
  ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
  grid = np.empty(len(ordered), dtype=object)
  grid[:] = ordered
  if cluster.device_place_prefer_intra_node:
    grid = grid.reshape(replicas, stages, context, per_stage)
  else:  # spread each replica over hosts: consecutive devices go to different replicas
    grid = grid.reshape(stages, context, per_stage, replicas).transpose(3, 0, 1, 2)
  axes = (DATA, STAGE, CONTEXT, MODEL)
  if context == 1:
    grid, axes = grid.reshape(replicas, stages, per_stage), AXES
  stage_of = tuple(0 if colocated else i for i in range(len(taskgraphs)))
  size = group_size(shard_size, replicas, per_replica, ordered, stages)
  if size < replicas:
    grid, axes = grid.reshape(replicas // size, size, *grid.shape[1:]), (REPLICA, *axes)
  mesh = Mesh(grid, axes, axis_types=(AxisType.Auto,) * len(axes))
  return Layout(mesh, replicas, stages, per_stage, stage_of, colocated, virtual_stages, context)


def group_size(shard_size: int | str, replicas: int, per_replica: int,
               devices: Sequence[jax.Device], stages: int = 1) -> int:
  """The data replicas of one hybrid-sharding group (``zero.shard_size``): ``"all"`` every
  replica; ``"host"`` those whose devices one host holds (all of them on one host); an int
  that divides the replicas."""
  if shard_size == "all":
    return replicas
  if shard_size == "host":
    per_host = min(Counter(d.process_index for d in devices).values())
    if per_host >= per_replica * replicas:
      return replicas
    if per_host % per_replica:
      raise PlanError(
          f"zero.shard_size='host': a host holds {per_host} devices, which is not a whole "
          f"number of model replicas of {per_replica} devices, so ZeRO's groups cannot be one "
          f"host's replicas. Set zero.shard_size to a number of replicas dividing {replicas} "
          f"(for example 1 group: 'all'), or use replicas whose device count divides "
          f"{per_host}.")
    shard_size = per_host // per_replica
  if replicas % shard_size:
    raise PlanError(
        f"zero.shard_size={shard_size} does not divide the {replicas} data replicas (the "
        f"'data' axis): ZeRO shards over groups of shard_size replicas and replicates across "
        f"the groups. Use a divisor of {replicas} "
        f"({', '.join(str(k) for k in range(1, replicas + 1) if replicas % k == 0)}), 'host' "
        f"or 'all'.")
  if shard_size < replicas and stages > 1:
    raise PlanError(
        f"zero.shard_size={shard_size} asks for hybrid sharding ({replicas // shard_size} "
        f"groups of {shard_size} replicas), which epljax does not combine with pipeline "
        f"stages ({stages} here) yet. Set zero.shard_size='all', or run without pipeline "
        f"stages.")
  return shard_size


def _check_virtual(taskgraphs: Sequence[TaskGraph], v: int, colocated: bool) -> None:
  if v == 1:
    return
  count = len(taskgraphs)
  if colocated:
    raise PlanError(
        f"pipeline.num_virtual_stages={v} interleaves pipeline stages, but the model's task "
        f"graphs {_listing(taskgraphs)} are " + ("colocated (cluster.colocate_split_and_"
        "replicate=True)" if count > 1 else "a single one") + ": there is no pipeline. Cut the "
        f"model into S x {v} stages (`with epl.replicate(1, name=...)` scopes, or "
        "auto.auto_parallel with pipeline.num_stages=S), or set pipeline.num_virtual_stages=1.")
  if count % v or count // v < 2:
    raise PlanError(
        f"pipeline.num_virtual_stages={v}: the model has {count} stage task graphs "
        f"({_listing(taskgraphs)}), which do not make {v} chunks on each of 2 or more "
        f"pipeline stages. Interleaving S stages needs S x {v} task graphs (chunk c runs on "
        f"stage c % S): cut the model into {max(2, -(-count // v)) * v} stages, or set "
        f"pipeline.num_virtual_stages to a divisor of {count} below {count}.")


def _listing(taskgraphs: Sequence[TaskGraph]) -> str:
  return ", ".join(f"'{tg.name}' {tg.strategy}({tg.device_count})" for tg in taskgraphs)
