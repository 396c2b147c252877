import jax
import numpy as np
import pytest

import epljax as epl
from epljax.config import ClusterConfig
from epljax.mesh import build_mesh

R, S = "replicate", "split"


def tgs(*specs):
  return [epl.TaskGraph(i, f"tg{i}", kind, count) for i, (kind, count) in enumerate(specs)]


def ids(layout):
  return np.vectorize(lambda d: d.id)(layout.mesh.devices)


@pytest.mark.parametrize("graphs, colocate, shape, replicas, stages", [
    (tgs((R, 1)), False, (8, 1, 1), 8, 1),                   # plain data parallelism
    (tgs((R, 2)), False, (4, 1, 2), 4, 1),                   # replicate(2): 4 replicas
    (tgs((S, 4)), False, (2, 1, 4), 2, 1),                   # split(4): nested DP of 2
    (tgs((R, 1), (R, 1)), False, (4, 2, 1), 4, 2),           # 2 stages -> 4 pipelines
    (tgs((R, 1), (R, 1), (R, 1), (R, 1)), False, (2, 4, 1), 2, 4),
    (tgs((R, 2), (S, 2)), False, (2, 2, 2), 2, 2),           # stages of 2 devices each
    (tgs((R, 8), (S, 8)), True, (1, 1, 8), 1, 1),            # EPL's large classification
    (tgs((R, 4), (S, 4)), True, (2, 1, 4), 2, 1),
])
def test_epl_placement_rules(graphs, colocate, shape, replicas, stages):
  layout = build_mesh(graphs, jax.devices(),
                      ClusterConfig(colocate_split_and_replicate=colocate))
  assert layout.mesh.axis_names == ("data", "stage", "model")
  assert layout.mesh.devices.shape == shape
  assert (layout.num_replicas, layout.num_stages) == (replicas, stages)
  assert layout.devices_per_replica * replicas == 8


def test_a_replica_is_consecutive_devices_by_default_and_spread_otherwise():
  devices = list(reversed(jax.devices()))   # order given does not matter: sorted by host, id
  near = build_mesh(tgs((R, 2), (R, 2)), devices, ClusterConfig())
  assert ids(near).tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
  far = build_mesh(tgs((R, 2), (R, 2)), devices,
                   ClusterConfig(device_place_prefer_intra_node=False))
  assert ids(far).tolist() == [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]


@pytest.mark.parametrize("graphs, colocate, message", [
    (tgs((R, 3)), False, r"One model replica needs 3 devices \('tg0' replicate\(3\)\), and 8 "
                         r"devices do not divide into replicas of 3"),
    (tgs((S, 16)), False, r"One model replica needs 16 devices .* but only 8 devices are "
                          "available"),
    (tgs((R, 1), (R, 1), (R, 1)), False,
     r"needs 3 devices \(the sum over the stages 'tg0' replicate\(1\), 'tg1' replicate\(1\), "
     r"'tg2' replicate\(1\)\)"),
    (tgs((R, 1), (S, 2)), False, r"use different device counts, but task graphs that are not "
                                 r"colocated are pipeline stages.*colocate_split_and_replicate"),
    (tgs((R, 8), (S, 4)), True, "colocated task graphs share their devices"),
])
def test_placement_errors_name_the_sizes(graphs, colocate, message):
  with pytest.raises(epl.PlanError, match=message):
    build_mesh(graphs, jax.devices(), ClusterConfig(colocate_split_and_replicate=colocate))


def test_visible_devices_shrink_the_mesh():
  cluster = epl.init({"cluster.run_visible_devices": "4,5,6,7"}).cluster
  layout = build_mesh(tgs((R, 1)), cluster.devices, ClusterConfig())
  assert ids(layout).ravel().tolist() == [4, 5, 6, 7]
