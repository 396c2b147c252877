"""jax's newer mesh APIs (``jax.make_mesh`` with Explicit axes, ``jax.sharding.reshard``,
``jax.set_mesh``) meeting epljax, and jax's own deprecation warnings raised by epljax's calls.

A model whose values carry Explicit sharding types, or a mesh with Explicit axes set around
epljax with ``jax.set_mesh``, is refused under every strategy with a ``PlanError`` that shows
the change (each refusal comes from tracing ``init_fn``: nothing compiles); with the change
the model is the zoo's ``own_mesh`` GPT, which ``test_own_mesh.py`` trains exactly under data
parallelism, split and pipelines, and this file under ZeRO inside ``jax.set_mesh`` of its
Auto-axes mesh.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np
import optax
import pytest
from flax.core import meta
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import epljax as epl
from helpers import TOL, assert_trees_close, reference_run
from models import common, own_mesh

PIPE = {"auto.auto_parallel": True, "pipeline.num_stages": 2, "pipeline.num_micro_batch": 2}
STRATEGIES = {"dp": ({}, False), "split": ({}, True), "zero": ({"zero.level": "v1"}, False),
              "pipeline": (PIPE, False)}


def explicit_mesh():
  """The model's mesh as jax >= 0.9 makes it by default: every axis Explicit."""
  return jax.make_mesh((2, 2, 2), own_mesh.AXES)


class ReshardBlock(own_mesh.Block):
  """The zoo block, its activations moved with ``jax.sharding.reshard`` (Explicit axes only)."""

  def constrain(self, x):
    return jax.sharding.reshard(x, NamedSharding(explicit_mesh(), self.spec))


def init(config, split, model=None):
  epl.init(config)
  if split:
    epl.annotate({"OwnMeshGPT": epl.split(2)})
  init_fn, loss_fn = own_mesh.fns(model)
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  return trainer.init(jax.random.key(0), common.token_batch(16, own_mesh.LENGTH,
                                                             own_mesh.VOCAB))


class AutoBlock(own_mesh.Block):
  """The fix the refusal shows: ``jax.make_mesh`` with Auto axes, ``with_sharding_constraint``."""

  def constrain(self, x):
    mesh = jax.make_mesh((2, 2, 2), own_mesh.AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, self.spec))


@pytest.fixture
def reshard_model(monkeypatch):
  monkeypatch.setattr(own_mesh, "Block", ReshardBlock)
  return own_mesh.OwnMeshGPT()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_model_with_explicit_sharding_types_is_told_to_use_auto_axes(strategy, reshard_model):
  config, split = STRATEGIES[strategy]
  with pytest.raises(epl.PlanError, match=(
      r"shardings on a mesh with Explicit axes \('data': 2, 'fsdp': 2, 'tensor': 2, "
      r"axis_types=\(Explicit, Explicit, Explicit\)\)(.|\n)*"
      r"axis_types=\(jax.sharding.AxisType.Auto,\) \* len\(names\)(.|\n)*"
      r"with_sharding_constraint\(x, NamedSharding\(mesh")):
    init(config, split, reshard_model)


def test_the_fix_trains_exactly_under_zero_inside_set_mesh(monkeypatch):
  """ZeRO, the strategy test_own_mesh.py does not train the own-mesh GPT under, all of it
  inside ``jax.set_mesh`` of the model's (Auto) mesh, which epljax sets aside while it plans:
  loss, first gradients (the momentum trace) and parameters after two steps against one
  device."""
  monkeypatch.setattr(own_mesh, "Block", AutoBlock)
  auto = jax.make_mesh((2, 2, 2), own_mesh.AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)
  # The key is made outside: on jax 0.10 a key made under jax.set_mesh carries that mesh in
  # its type into epljax's init (JAX: "Mesh for all inputs should be equal"); on 0.12 not.
  rng = jax.random.key(0)
  with jax.set_mesh(auto):
    trainer = _zero_against_reference(rng)
  assert "zero" in str(trainer.plan).lower()


def _zero_against_reference(rng):
  init_fn, loss_fn = own_mesh.fns()
  batch = common.token_batch(16, own_mesh.LENGTH, own_mesh.VOCAB)
  history, expected = reference_run(init_fn, loss_fn, optax.sgd(0.1, momentum=0.9),
                                    rng, batch, 2)
  epl.init({"zero.level": "v1"})
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1, momentum=0.9))
  state = trainer.init(rng, batch)
  for step in range(2):
    state, metrics = trainer.train_step(state, batch)
    np.testing.assert_allclose(metrics["loss"], history[step][0], **TOL)
    if step == 0:
      assert_trees_close(meta.unbox(optax.tree_utils.tree_get(state.opt_state, "trace")),
                         history[0][1])
  assert_trees_close(meta.unbox(trainer.variables(state)), expected)
  return trainer


@pytest.mark.parametrize("strategy", ["dp", "pipeline"])
def test_a_mesh_with_explicit_axes_set_around_epljax_is_refused_by_name(strategy):
  config, split = STRATEGIES[strategy]
  with jax.set_mesh(explicit_mesh()):
    with pytest.raises(epl.PlanError, match=(
        r"A mesh \(data=2, fsdp=2, tensor=2\) with Explicit axes \(Explicit, Explicit, "
        r"Explicit\) is set around epljax \(jax.set_mesh(.|\n)*Set a mesh with Auto axes(.|\n)*"
        r"axis_types=\(jax.sharding.AxisType.Auto,\) \* len\(names\)")):
      init(config, split)


def test_jax_deprecations_raised_by_epljax_calls_fail_the_tests():
  """pyproject's filter (``error::DeprecationWarning:epljax``) reads the module a warning is
  attributed to: jax's ``with mesh:`` warning points at its caller (stacklevel 2), so it fails
  a test when epljax makes the call, and only warns when a model does."""
  probe = "def enter(mesh):\n  with mesh:\n    pass\n"
  calls = {}
  for module in ("epljax._probe", "models._probe"):
    exec(compile(probe, f"<{module}>", "exec"), scope := {"__name__": module})   # noqa: S102
    calls[module] = scope["enter"]
  mesh = own_mesh.own_mesh()
  with pytest.raises(DeprecationWarning, match=r"`with mesh:` context manager"):
    calls["epljax._probe"](mesh)
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("default", DeprecationWarning)   # shown, as pytest shows it
    calls["models._probe"](mesh)
  assert [type(w.message) for w in seen] == [DeprecationWarning]


def _on_axis_types(tree, mesh, axis_type):
  """``tree``'s arrays moved onto a twin of ``mesh`` (same devices and names) of ``axis_type``."""
  twin = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(axis_type,) * len(
      mesh.axis_names))
  return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(twin, x.sharding.spec)), tree)


def test_a_checkpoint_restores_across_axis_types(tmp_path):
  """Saved from arrays on Explicit axes, restored into epljax's Auto shardings; and epljax's
  checkpoint read by a program whose mesh has Explicit axes. Values exact both ways."""
  import orbax.checkpoint as ocp

  from test_checkpoint import make_trainer, numpy_tree
  trainer, state = make_trainer("dp", hidden=8)
  mesh, explicit = trainer.plan.mesh, jax.sharding.AxisType.Explicit
  expected = numpy_tree(trainer.variables(state))
  ckpt = epl.Checkpointer(tmp_path / "epl")
  ckpt.save(1, _on_axis_types(state, mesh, explicit))
  ckpt.save(2, state)
  ckpt.wait()
  restored = ckpt.restore(trainer, step=1)
  for x, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    assert x.sharding == want.sharding, (x.sharding, want.sharding)   # Auto again
  assert_trees_close(numpy_tree(trainer.variables(restored)), expected, dict(rtol=0, atol=0))
  # Step 2 (saved on Auto axes) read by a jax program whose mesh has Explicit axes.
  twin = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(explicit,) * 3)
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(
      tuple(m.shape), m.dtype, sharding=NamedSharding(twin, P())),
      dict(ckpt._manager.item_metadata(2)["default"]))
  read = ocp.StandardCheckpointer().restore(tmp_path / "epl" / "2" / "default", target)
  assert {x.sharding.mesh.axis_types for x in jax.tree.leaves(read)} == {(explicit,) * 3}
  assert_trees_close(numpy_tree(read["params"]), expected["params"], dict(rtol=0, atol=0))
