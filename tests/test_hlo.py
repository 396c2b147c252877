# ruff: noqa: E501  (HLO lines are long)
import dataclasses

import pytest

from epljax import hlo

HLO = """
  %all-reduce.3 = (f32[1,256,1024]{2,1,0}, f32[1,1024,256]{2,1,0}) all-reduce(%a, %b), channel_id=1, replica_groups={{0},{1},{2},{3}}, use_global_device_ids=true, to_apply=%region
  %all-reduce.2 = (f32[8,256]{1,0}, f32[]) all-reduce(%c, %d), channel_id=2, replica_groups=mesh['axis_0'=8,'axis_1'=1,'axis_2'=1] {'axis_0'}, use_global_device_ids=true, to_apply=%add
  ROOT %ag = bf16[16,32]{1,0} all-gather(bf16[4,32]{1,0} %x), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}
  %ags = (f32[4,32]{1,0}, f32[16,32]{1,0}) all-gather-start(f32[4,32]{1,0} %y), channel_id=4, replica_groups={{0,1,2,3}}
  %agd = f32[16,32]{1,0} all-gather-done(%ags)
  %rs = s32[2]{0} reduce-scatter(s32[8]{0} %z), replica_groups={{0,1,2,3}}, dimensions={0}
"""


def test_collectives_are_read_with_their_bytes_and_groups():
  found = hlo.collectives(HLO)
  assert [(c.kind, c.shapes, c.bytes, c.group_size) for c in found] == [
      ("all-reduce", ("f32[8,256]", "f32[]"), 8 * 256 * 4 + 4, 8),
      ("all-gather", ("bf16[16,32]",), 16 * 32 * 2, 4),
      ("all-gather", ("f32[16,32]",), 16 * 32 * 4, 4),       # async: counted once, by result
      ("reduce-scatter", ("s32[2]",), 8, 4),
  ]
  assert len(hlo.collectives(HLO, include_trivial=True)) == 5   # + the one-device groups
  assert hlo.summarize(found) == {"all-reduce": (1, 8196), "all-gather": (2, 3072),
                                  "reduce-scatter": (1, 8)}


GPU_ASYNC = """
  %ars = ((f32[2,16,32]{2,1,0}), f32[2,16,32]{2,1,0}) all-reduce-start(%b), channel_id=5, replica_groups=[4,2]<=[8], use_global_device_ids=true, to_apply=%add, output_to_operand_aliasing={{1}: (0, {})}
  %ard = f32[2,16,32]{2,1,0} all-reduce-done(%ars)
  %ars2 = ((f32[8]{0}, f32[3]{0}), f32[8]{0}, f32[3]{0}) all-reduce-start(%c, %d), channel_id=6, replica_groups=[2,4]<=[4,2]T(1,0), use_global_device_ids=true, to_apply=%add
  %cps = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%p), channel_id=7, source_target_pairs={{0,1},{1,0}}
"""


def test_async_collectives_of_xla_gpu_count_their_results_once():
  """XLA:GPU's all-reduce-start types are ((operands...), results...): the operands are not
  moved twice (this read double the bytes of every async all-reduce)."""
  found = hlo.collectives(GPU_ASYNC)
  assert [(c.kind, c.shapes, c.bytes, c.group_size) for c in found] == [
      ("all-reduce", ("f32[2,16,32]",), 2 * 16 * 32 * 4, 2),
      ("all-reduce", ("f32[8]", "f32[3]"), 11 * 4, 4),
      ("collective-permute", ("f32[8]",), 8 * 4, None),
  ]


def test_collectives_in_a_scanned_loop_count_once_per_iteration():
  """A scan over 3 layers whose matmul contracts a split dimension: one all-reduce stands in
  the loop body and runs 3 times, in the forward and again in the backward."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = Mesh(jax.devices()[:2], ("model",))

  def loss(w, x):
    return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0].sum()

  w = jax.device_put(jnp.ones((3, 8, 8)), NamedSharding(mesh, P(None, "model", None)))
  x = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P()))
  forward = jax.jit(loss).lower(w, x).compile().as_text()
  layer = "f32[4,8]"
  assert sum(c.shapes == (layer,) for c in hlo.collectives(forward)) == 1
  assert sum(c.shapes == (layer,) for c in hlo.executed_collectives(forward)) == 3
  backward = jax.jit(jax.grad(loss)).lower(w, x).compile().as_text()
  executed = hlo.executed_collectives(backward)
  assert len(executed) == 3 * len(hlo.collectives(backward)) > 0   # every one is in a loop


BRANCHED = """
%permute_in_branch (p: f32[4]) -> f32[4] {
  ROOT %cp = f32[4]{0} collective-permute(%p), channel_id=1, source_target_pairs={{0,1},{1,0}}
}

%idle (p.1: f32[4]) -> f32[4] {
  ROOT %p.2 = f32[4]{0} copy(%p.1)
}

%after (p.3: f32[4]) -> f32[4] {
  ROOT %ar = f32[4]{0} all-reduce(%p.3), channel_id=2, replica_groups={{0,1}}, to_apply=%add
}

ENTRY %main (a: f32[4], i: s32[]) -> f32[4] {
  %c = f32[4]{0} conditional(%i, %a, %a), branch_computations={%permute_in_branch, %idle}
  ROOT %r = f32[4]{0} call(%c), to_apply=%after
}
"""


def test_collectives_in_branches_are_those_only_some_devices_may_reach():
  assert [c.kind for c in hlo.collectives_in_branches(BRANCHED)] == ["collective-permute"]
  permute, = hlo.collectives_in_branches(BRANCHED)
  assert permute.source_target_pairs == "{{0,1},{1,0}}" and permute.connected() == [[0, 1]]
  joined = dataclasses.replace(permute, source_target_pairs="{{0,1},{2,3},{1,2},{4,5}}")
  assert sorted(joined.connected()) == [[0, 1, 2, 3], [4, 5]]
  assert [c.kind for c in hlo.executed_collectives(BRANCHED)] == [
      "collective-permute", "all-reduce"]


# The same conditional, once at the top (a step-wide cond) and once inside a while body (a
# pipeline loop's switch).
LOOPED = BRANCHED.replace("ENTRY %main", "%loop_body") + """
%loop_cond (s: (f32[4], s32[])) -> pred[] {
  ROOT %t = pred[] constant(true)
}

ENTRY %main2 (a: f32[4], i: s32[]) -> f32[4] {
  %w = (f32[4], s32[]) while(%a), condition=%loop_cond, body=%loop_body
  ROOT %c2 = f32[4]{0} conditional(%i, %a, %a), branch_computations={%permute_in_branch, %idle}
}
"""


def test_collectives_in_branches_in_loops_are_those_of_a_conditional_in_a_while_body():
  assert [c.kind for c in hlo.collectives_in_branches(BRANCHED, in_loops=True)] == []
  assert [c.kind for c in hlo.collectives_in_branches(LOOPED, in_loops=True)] == [
      "collective-permute"]
  assert [c.kind for c in hlo.collectives_in_branches(LOOPED)] == ["collective-permute"]


def test_replica_groups_are_read_in_every_form_xla_prints():
  def groups(text):
    return hlo.Collective("all-reduce", (), 0, text).device_groups(8)

  assert groups("{{0,1},{2,3},{4,5},{6,7}}") == [[0, 1], [2, 3], [4, 5], [6, 7]]
  assert groups("{}") == [list(range(8))]
  assert groups("[4,2]<=[8]") == [[0, 1], [2, 3], [4, 5], [6, 7]]
  assert groups("[2,4]<=[4,2]T(1,0)") == [[0, 2, 4, 6], [1, 3, 5, 7]]
  assert groups("[4,2]<=[2,2,2]T(0,2,1)") == [[0, 2], [1, 3], [4, 6], [5, 7]]
  # jax 0.11's XLA names mesh axes; device ids are row-major over them (the mesh's devices)
  assert groups("mesh['x'=8]{'x'}") == [list(range(8))]
  assert groups("mesh['data'=2,'stage'=2,'model'=2] {'data'}") == [[0, 4], [1, 5], [2, 6],
                                                                  [3, 7]]
  assert groups("mesh['data'=2,'stage'=2,'model'=2] {'data','model'}") == [[0, 1, 4, 5],
                                                                           [2, 3, 6, 7]]
  assert groups("mesh['x'=4]{'x'}") is None    # not this program's 8 devices: not guessed
  assert groups("<=[8] something new") is None  # a form not read: the caller must not guess


def test_mesh_groups_with_their_device_order_are_read_whole():
  """jax 0.10.2's XLA writes ``replica_groups=mesh[...], device_ids=([2,4]T(1,0)) {axes}``: the
  device order and the axes stay with the groups (a hybrid-sharding step's gather over
  'data', groups of 4, read before as one group of all 8)."""
  line = ("  %ag = f32[64,16]{1,0} all-gather(%p), channel_id=8, replica_groups=mesh['axis_0'=4,"
          "'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}, "
          "use_global_device_ids=true\n")
  (c,) = hlo.collectives(line)
  assert c.group_size == 4
  assert c.device_groups(8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
  # ids iota([2,4]) transposed: mesh position (i, 0, j) holds device 4j + i.
  other = c.replica_groups.replace("{'axis_0'}", "{'axis_2'}")
  assert hlo.Collective("all-gather", (), 0, other).device_groups(8) == [
      [0, 4], [1, 5], [2, 6], [3, 7]]


# A loop of 4 ticks whose body switches between two branches, as a pipeline's tick loop does:
# each tick a device runs one of them.
SWITCHED = """
%small (p: f32[4]) -> f32[4] {
  ROOT %ar.s = f32[4]{0} all-reduce(%p), channel_id=1, replica_groups={{0,1}}, to_apply=%add
}

%large (q: f32[4]) -> f32[4] {
  %ar.l = f32[16]{0} all-reduce(%q), channel_id=2, replica_groups={{0,1}}, to_apply=%add
  ROOT %s = f32[4]{0} slice(%ar.l), slice={[0:4]}
}

%tick (t: (f32[4], s32[])) -> (f32[4], s32[]) {
  %c = f32[4]{0} conditional(%i, %a, %a), branch_computations={%small, %large}, metadata={op_name="jit(step)/while/body/pipeline_forward/cond" stack_frame_id=3}
  %cp = f32[4]{0} collective-permute(%c), channel_id=3, source_target_pairs={{0,1},{1,0}}
  ROOT %r = (f32[4], s32[]) tuple(%cp, %i)
}

%tick_cond (u: (f32[4], s32[])) -> pred[] {
  ROOT %k = pred[] constant(true)
}

ENTRY %main (a: f32[4]) -> (f32[4], s32[]) {
  ROOT %w = (f32[4], s32[]) while(%a), condition=%tick_cond, body=%tick, backend_config={"known_trip_count":{"n":"4"}}
}
"""


def test_a_conditional_runs_one_branch_each_time():
  """Each tick runs one branch: by default the heaviest counts for every tick (the most a
  device can execute; summing both branches counted bytes no device moves), and ``taken``
  says which share of the ticks take each branch (a pipeline stage's tick table)."""
  def shapes(found):
    return sorted(s for c in found for s in c.shapes)

  assert shapes(hlo.executed_collectives(SWITCHED)) == ["f32[16]"] * 4 + ["f32[4]"] * 4
  taken = hlo.executed_collectives(SWITCHED, taken={"pipeline_forward": [0.25, 0.75]})
  assert shapes(taken) == ["f32[16]"] * 3 + ["f32[4]"] * 5   # 1 small, 3 large, 4 permutes
  idle = hlo.executed_collectives(SWITCHED, taken={"pipeline_forward": [0.5]})
  assert shapes(idle) == ["f32[4]"] * 6                       # 2 small, never large
  assert shapes(hlo.executed_collectives(SWITCHED, taken={"other_scope": [1, 0]})) == shapes(
      hlo.executed_collectives(SWITCHED))
  with pytest.raises(ValueError, match="3 shares to the conditional .* of 2 branches"):
    hlo.executed_collectives(SWITCHED, taken={"pipeline_forward": [0.25, 0.25, 0.5]})
