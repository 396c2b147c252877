"""Capture: every equation and parameter gets the task graph EPL's rules give it."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import epljax as epl
from epljax.sharding.capture import capture
from epljax.variables import Model


def run_capture(loss, variables, batch):
  """Captures ``loss(variables, batch)``; returns (task graphs, {path: task graph name})."""
  leaves, treedef = jax.tree.flatten(variables)
  paths = [jax.tree_util.keystr(p, simple=True, separator="/")
           for p, _ in jax.tree_util.tree_flatten_with_path(variables)[0]]
  b_leaves, b_def = jax.tree.flatten(batch)

  def flat(*args):
    return loss(jax.tree.unflatten(treedef, args[:len(leaves)]),
                jax.tree.unflatten(b_def, args[len(leaves):]))

  cap = capture(flat, leaves, b_leaves, input_paths=paths, num_devices=8)
  names = {p: (cap.taskgraphs[t].name if t is not None else None)
           for p, t in zip(paths, cap.input_taskgraph)}
  return cap, names


def mlp_params(*sizes):
  keys = jax.random.split(jax.random.key(0), len(sizes) - 1)
  return {f"w{i}": jax.random.normal(k, (a, b)) for i, (k, a, b) in
          enumerate(zip(keys, sizes[:-1], sizes[1:]))}


X = {"x": jnp.ones((4, 8)), "y": jnp.ones((4, 2))}


def test_no_annotation_is_one_replicate_taskgraph():
  def loss(p, b):
    return jnp.mean((b["x"] @ p["w0"] @ p["w1"] - b["y"]) ** 2)

  cap, names = run_capture(loss, mlp_params(8, 4, 2), X)
  assert cap.taskgraphs == (epl.TaskGraph(0, "taskgraph_0", "replicate", 1),)
  assert set(names.values()) == {"taskgraph_0"}
  assert set(cap.node_taskgraph) == {0}


def test_scopes_in_order_with_code_before_and_after_joining_by_data_flow():
  def loss(p, b):
    x = b["x"] * 2.0                        # before the first scope -> stage_0
    with epl.replicate(1, name="stage_0"):
      h = jnp.tanh(x @ p["w0"])
    h = h + 1.0                             # between scopes -> stage_0 (its producer)
    with epl.replicate(1, name="stage_1"):
      out = h @ p["w1"]
    target = b["y"] * 3.0                   # only feeds the loss -> stage_1 (its consumer)
    return jnp.mean((out - target) ** 2)    # after the last scope -> stage_1

  cap, names = run_capture(loss, mlp_params(8, 4, 2), X)
  assert [(t.index, t.name, t.strategy, t.device_count) for t in cap.taskgraphs] == [
      (0, "stage_0", "replicate", 1), (1, "stage_1", "replicate", 1)]
  assert names == {"w0": "stage_0", "w1": "stage_1"}
  by_prim = {}
  for node in cap.program.nodes:
    by_prim.setdefault(node.primitive, set()).add(cap.node_taskgraph[node.index])
  assert by_prim["tanh"] == {0}
  assert by_prim["reduce_sum"] == {1}   # the mean of the loss
  mul_nodes = [n for n in cap.program.nodes if n.primitive == "mul"]
  assert [cap.node_taskgraph[n.index] for n in mul_nodes] == [0, 1]   # x*2 and y*3


def test_top_level_default_and_a_split_scope_like_epls_moe():
  epl.set_default_strategy(epl.replicate(8))

  def loss(p, b):
    gate = jax.nn.softmax(b["x"] @ p["w0"])            # default strategy
    with epl.split(8, name="experts"):
      expert = jnp.einsum("bd,df->bf", gate, p["w1"])  # split
    return jnp.mean(expert ** 2)                       # default strategy again

  cap, names = run_capture(loss, mlp_params(8, 4, 2), X)
  assert [(t.name, t.strategy, t.device_count) for t in cap.taskgraphs] == [
      ("taskgraph_0", "replicate", 8), ("experts", "split", 8)]
  assert names == {"w0": "taskgraph_0", "w1": "experts"}


def test_set_default_strategy_during_the_trace_cuts_task_graphs_like_epls_bert():
  class Bert(nn.Module):
    @nn.compact
    def __call__(self, x):
      epl.set_default_strategy(epl.replicate(1))
      x = nn.Dense(4, name="layer0")(x)
      epl.set_default_strategy(epl.replicate(1))
      return nn.Dense(2, name="layer1")(jnp.tanh(x))

  model = Bert()
  variables = model.init(jax.random.key(0), X["x"])
  cap, names = run_capture(
      lambda v, b: jnp.mean((model.apply(v, b["x"]) - b["y"]) ** 2), variables, X)
  assert [t.name for t in cap.taskgraphs] == ["taskgraph_0", "taskgraph_1"]
  assert names == {"params/layer0/bias": "taskgraph_0", "params/layer0/kernel": "taskgraph_0",
                   "params/layer1/bias": "taskgraph_1", "params/layer1/kernel": "taskgraph_1"}
  # The loss, traced after the model's scope closed, joins the last task graph.
  loss_nodes = [n for n in cap.program.nodes if n.primitive == "integer_pow"]
  assert [cap.node_taskgraph[n.index] for n in loss_nodes] == [1]
  # model.init above ran the model eagerly and so set a global default; it does not add a
  # task graph in front of this program, whose own calls cut it.
  assert epl.strategy.default_strategy() is not None


def test_set_default_strategy_during_a_trace_does_not_change_the_global_default():
  def loss(p, b):
    epl.set_default_strategy(epl.split(2))
    return jnp.mean(b["x"] @ p["w0"])

  cap, names = run_capture(loss, mlp_params(8, 2), X)
  assert [(t.strategy, t.device_count) for t in cap.taskgraphs] == [("split", 2)]
  assert epl.strategy.default_strategy() is None


def test_unnamed_scope_entered_twice_is_two_task_graphs_and_shared_weights_are_refused():
  def layer(w, x):
    with epl.replicate(1):
      return jnp.tanh(x @ w)

  def loss(p, b):
    return jnp.mean(layer(p["w0"], layer(p["w0"], b["x"] @ p["w1"])))

  params = {"w0": jnp.ones((4, 4)), "w1": jnp.ones((8, 4))}
  with pytest.raises(epl.PlanError, match=(
      r"Parameter 'w0' \(shape \(4, 4\)\) is used by two task graphs: 'taskgraph_0' "
      r"\(replicate\(1\)\) and 'taskgraph_1' \(replicate\(1\)\)(.|\n)*give it a name")):
    run_capture(loss, params, X)


def test_named_scope_entered_twice_is_one_task_graph():
  def layer(w, x):
    with epl.replicate(1, name="block"):
      return jnp.tanh(x @ w)

  def loss(p, b):
    return jnp.mean(layer(p["w0"], layer(p["w0"], b["x"] @ p["w1"])))

  params = {"w0": jnp.ones((4, 4)), "w1": jnp.ones((8, 4))}
  cap, names = run_capture(loss, params, X)
  assert [t.name for t in cap.taskgraphs] == ["block"]
  assert names == {"w0": "block", "w1": "block"}


def test_unnamed_scopes_in_a_loop_are_one_task_graph_each():
  def loss(p, b):
    x = b["x"] @ p["w0"]
    for i in range(3):
      with epl.replicate(1):
        x = jnp.tanh(x @ p[f"l{i}"])
    return jnp.mean(x)

  params = {"w0": jnp.ones((8, 4)), **{f"l{i}": jnp.ones((4, 4)) for i in range(3)}}
  cap, names = run_capture(loss, params, X)
  assert [t.name for t in cap.taskgraphs] == ["taskgraph_0", "taskgraph_1", "taskgraph_2"]
  assert names == {"w0": "taskgraph_0", "l0": "taskgraph_0", "l1": "taskgraph_1",
                   "l2": "taskgraph_2"}


def test_one_name_for_two_strategies_is_refused():
  def loss(p, b):
    with epl.replicate(1, name="x"):
      h = b["x"] @ p["w0"]
    with epl.split(2, name="x"):
      return jnp.mean(h @ p["w1"])

  with pytest.raises(epl.ScopeError, match=r"The name 'x' is used by two different strategies: "
                     r"epl.replicate\(1\) and epl.split\(2\)"):
    run_capture(loss, mlp_params(8, 4, 2), X)


def test_tags_survive_jit_caching_custom_jvp_scan_and_remat():
  @jax.jit
  def block(w, x):
    with epl.split(2, name="inner"):
      return jax.nn.relu(x @ w)

  block(jnp.ones((8, 4)), jnp.ones((4, 8)))   # fill the jit cache before the capture

  def loss(p, b):
    h = block(p["w0"], b["x"])
    with epl.replicate(2, name="outer"):
      def body(c, _):
        return jnp.tanh(c @ p["w1"] @ p["w2"]), None
      h2, _ = jax.lax.scan(body, h @ p["w3"], None, length=2)
      h3 = jax.checkpoint(lambda z: jnp.sin(z) @ p["w4"])(h2)
    return jnp.mean(h3)

  params = {"w0": jnp.ones((8, 4)), "w1": jnp.ones((2, 3)), "w2": jnp.ones((3, 2)),
            "w3": jnp.ones((4, 2)), "w4": jnp.ones((2, 2))}
  cap, names = run_capture(loss, params, X)
  assert [t.name for t in cap.taskgraphs] == ["inner", "outer"]
  assert names == {"w0": "inner", "w1": "outer", "w2": "outer", "w3": "outer", "w4": "outer"}
  enclosing = {n.primitive: n.enclosing for n in cap.program.nodes}
  assert enclosing["max"][:2] == ("jit", "custom_jvp_call")
  assert enclosing["tanh"] == ("scan",)
  assert enclosing["sin"][0].startswith("remat")


def test_linen_and_nnx_models_capture_the_same_task_graphs():
  class Linen(nn.Module):
    @nn.compact
    def __call__(self, x):
      with epl.replicate(1, name="body"):
        x = nn.Dense(4)(x)
      with epl.split(2, name="head"):
        return nn.Dense(2)(x)

  class NNX(nnx.Module):
    def __init__(self, rngs):
      self.body = nnx.Linear(8, 4, rngs=rngs)
      self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
      with epl.replicate(1, name="body"):
        x = self.body(x)
      with epl.split(2, name="head"):
        return self.head(x)

  linen = Linen()
  linen_vars = linen.init(jax.random.key(0), X["x"])
  _, linen_names = run_capture(lambda v, b: jnp.mean(linen.apply(v, b["x"])), linen_vars, X)
  assert linen_names == {"params/Dense_0/bias": "body", "params/Dense_0/kernel": "body",
                         "params/Dense_1/bias": "head", "params/Dense_1/kernel": "head"}

  model, params, rest = Model.split(NNX(nnx.Rngs(0)))
  call = model.loss_call(lambda m, b: jnp.mean(m(b["x"])), False, ())
  _, nnx_names = run_capture(lambda p, b: call(p, rest, b)[0], params, X)
  assert nnx_names == {"body/bias/value": "body", "body/kernel/value": "body",
                       "head/bias/value": "head", "head/kernel/value": "head"}


def test_unused_variables_have_no_task_graph():
  cap, names = run_capture(lambda p, b: jnp.mean(b["x"] @ p["w0"]),
                           {"w0": jnp.ones((8, 2)), "unused": jnp.ones(3)}, X)
  assert names == {"w0": "taskgraph_0", "unused": None}
  assert cap.input_taskgraph == (None, 0)   # leaves in path order: unused, w0
