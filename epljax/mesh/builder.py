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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from epljax.config import ClusterConfig
from epljax.errors import PlanError
from epljax.strategy import TaskGraph

DATA, STAGE, MODEL = "data", "stage", "model"
AXES = (DATA, STAGE, MODEL)
# GSPMD decides every intermediate sharding (Auto). jax 0.11 makes a bare AbstractMesh
# Explicit, where Flax's logical-axis constraints become assertions: always say Auto.
_AUTO = (AxisType.Auto,) * len(AXES)


def abstract_mesh(sizes: Sequence[int] = (1,) * len(AXES)) -> AbstractMesh:
  """An abstract (data, stage, model) mesh with GSPMD-decided (Auto) axes, on every jax."""
  return AbstractMesh(tuple(sizes), AXES, axis_types=_AUTO)


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

  @property
  def devices_per_replica(self) -> int:
    return self.num_stages * self.devices_per_stage


def build_mesh(taskgraphs: Sequence[TaskGraph], devices: Sequence[jax.Device],
               cluster: ClusterConfig, virtual_stages: int = 1) -> Layout:
  """Task graphs + devices -> ``Layout`` (see the module doc for the rules). With
  ``virtual_stages = v > 1`` the task graphs are pipeline chunks, ``v`` per stage."""
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
  per_replica = per_stage * stages
  total = len(devices)
  how = (f"{_listing(taskgraphs)}" if colocated or len(taskgraphs) == 1 else
         f"the sum over the stages {_listing(taskgraphs)}")
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
  ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
  grid = np.empty(len(ordered), dtype=object)
  grid[:] = ordered
  if cluster.device_place_prefer_intra_node:
    grid = grid.reshape(replicas, stages, per_stage)
  else:  # spread each replica over hosts: consecutive devices go to different replicas
    grid = grid.reshape(stages, per_stage, replicas).transpose(2, 0, 1)
  stage_of = tuple(0 if colocated else i for i in range(len(taskgraphs)))
  mesh = Mesh(grid, AXES, axis_types=_AUTO)
  return Layout(mesh, replicas, stages, per_stage, stage_of, colocated, virtual_stages)


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
