"""Models that bring their own mesh (MaxText's decoder): ``with_sharding_constraint`` on a
``Mesh`` the model builds, not epljax's (``epljax/sharding/constraints.py``).

The zoo's ``own_mesh`` GPT constrains its activations to ``P(('data', 'fsdp'), None,
'tensor')`` on a ``data 2 x fsdp 2 x tensor 2`` mesh of the 8 devices. It trains exactly (loss,
first gradients, parameters after two steps: 1e-5) under data parallelism, ``split`` and
``auto_parallel`` pipelines, where the constraints are translated onto epljax's mesh (kept
over ``model`` in split stages) or removed with a plan line; constraints that cannot be carried
are refused with a ``PlanError`` naming them.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
import pytest
from flax.core import meta
from jax.sharding import PartitionSpec as P

import epljax as epl
from helpers import TOL, assert_trees_close, reference_run
from models import common, own_mesh

ROWS, STEPS = 16, 2
PIPE = {"auto.auto_parallel": True, "pipeline.num_stages": 2, "pipeline.num_micro_batch": 2}
# layout -> (config, whole model under split(2)?, what the plan says of the constraints)
LAYOUTS = {
    "dp": ({}, False, None),
    "split": ({}, True, None),
    "pipeline_2": (PIPE, False, r"constraint stage 'stage_0': 3 x P\(\('data', 'fsdp'\), None, "
                   r"'tensor'\) on mesh \(data=2, fsdp=2, tensor=2\) at own_mesh.py:\d+.*: "
                   r"removed \('data', 'fsdp' -> data, manual in the stage"),
    "pipeline_split": (PIPE, True, r"constraint stage 'stage_1': .* kept as "
                       r"P\(None, None, 'model'\) on epljax's mesh"),
}


def optimizer():
  return optax.sgd(0.1, momentum=0.9)


def batch():
  return common.token_batch(ROWS, own_mesh.LENGTH, own_mesh.VOCAB)


_REFERENCE: dict = {}


def reference(model):
  key = (model.spec, model.axes, model.bare)
  if key not in _REFERENCE:
    init_fn, loss_fn = own_mesh.fns(model)
    _REFERENCE[key] = reference_run(init_fn, loss_fn, optimizer(), jax.random.key(0),
                                      batch(), STEPS)
  return _REFERENCE[key]


def train(model, config, split, rules=None):
  """Two steps of ``model`` with epljax, checked against the single-device reference."""
  history, expected = reference(model)
  epl.init(config)
  if split:
    epl.annotate({"OwnMeshGPT": epl.split(2)})
  init_fn, loss_fn = own_mesh.fns(model)
  trainer = epl.Trainer(init_fn, loss_fn, optimizer())
  with epl.mesh_axis_rules(rules or {}):
    state = trainer.init(jax.random.key(0), batch())
  for step in range(STEPS):
    state, metrics = trainer.train_step(state, batch())
    np.testing.assert_allclose(metrics["loss"], history[step][0], **TOL)
    if step == 0:   # SGD's momentum trace after one step is that step's gradient
      assert_trees_close(meta.unbox(optax.tree_utils.tree_get(state.opt_state, "trace")),
                         history[0][1])
  assert_trees_close(meta.unbox(trainer.variables(state)), expected)
  return trainer


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_model_with_its_own_mesh_trains_exactly(layout):
  config, split, says = LAYOUTS[layout]
  trainer = train(own_mesh.OwnMeshGPT(), config, split)
  if says is not None:
    assert re.search(says, str(trainer.plan)), str(trainer.plan)


def test_an_axis_no_rule_maps_is_refused_in_a_stage_unless_mapped():
  # 'sequence' (size 2) splits the positions: epljax has no sequence parallelism.
  model = own_mesh.OwnMeshGPT(spec=P("data", "sequence", None),
                              axes=("data", "sequence", "tensor"))
  with pytest.raises(epl.PlanError, match=(
      r"with_sharding_constraint P\('data', 'sequence', None\) on mesh \(data=2, sequence=2, "
      r"tensor=2\) on a value of shape \(2, 8, 16\), called at own_mesh.py:\d+:\d+ "
      r"\(Block.constrain\) in OwnMeshGPT/h_0/h_0.constrain,\nin stage 'stage_0': its "
      r"mesh axis 'sequence' \(size 2\) has no counterpart(.|\n)*"
      r"with epl.mesh_axis_rules\(\{'sequence': 'data'\}\)")):
    train(model, PIPE, False)
  # The fix the message gives: map it (here: drop it); then it trains exactly.
  trainer = train(model, PIPE, False, rules={"sequence": None})
  assert "'sequence' mapped to None" in str(trainer.plan)


def test_a_bare_spec_under_the_models_mesh_says_to_name_the_mesh():
  # A bare PartitionSpec is read against the context mesh, which is epljax's while it traces.
  with pytest.raises(epl.PlanError, match=(
      r"bare PartitionSpec P\(\('data', 'fsdp'\), None, 'tensor'\) names mesh axis 'fsdp'"
      r"(.|\n)*NamedSharding\(mesh, PartitionSpec\(...\)\)")):
    train(own_mesh.OwnMeshGPT(bare=True), {}, False)


def test_mesh_axis_rules_take_epljax_axes_only():
  with pytest.raises(epl.PlanError, match=r"mesh_axis_rules maps \{'sequence': 'seq'\}"):
    with epl.mesh_axis_rules({"sequence": "seq"}):
      pass


def test_the_per_replica_gradients_of_fp16_refuse_it_by_name():
  # communication.fp16 runs the model in a shard_map manual over data: no other mesh there.
  with pytest.raises(epl.PlanError, match=(
      r"with_sharding_constraint NamedSharding\(mesh=Mesh\('data': 2, 'fsdp': 2, 'tensor': 2"
      r"(.|\n)*called at own_mesh.py:\d+:\d+ \(Block.constrain\)(.|\n)*communication.fp16")):
    train(own_mesh.OwnMeshGPT(), {"communication.fp16": True}, False)
