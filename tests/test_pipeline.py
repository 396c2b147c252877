"""Pipeline parallelism against the single-device reference on the same global batch."""

import pytest

from pipeline_helpers import CASES, run_case


@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_device_reference(case):
  """Loss, gradients and parameters after 2 steps equal single-device training (1e-5); one
  compile of the step; shardings and dtypes kept (``run_case`` checks all of it)."""
  _, _, _, (replicas, stages, per_stage), _, distinct = CASES[case]
  trainer, _ = run_case(case)
  plan = trainer.plan
  assert (plan.num_replicas, plan.num_stages) == (replicas, stages)
  assert dict(plan.mesh.shape) == {"data": replicas, "stage": stages, "model": per_stage}
  assert len(plan.pipeline.branches) == distinct
  # Activations and gradients move between stages; gradients are reduced over replicas.
  assert {c.kind for c in plan.collectives} == {"collective-permute", "all-reduce"}
