"""Pipeline parallelism against the single-device reference on the same global batch."""

import optax
import pytest

import epljax as epl
from helpers import DEEP_TOL, TOL, classification_batch
from pipeline_helpers import Stack, TwoStages, adamw, check_matches_reference

BACKWARD = {"pipeline.strategy": "PreferBackward"}
FORWARD = {"pipeline.strategy": "PreferForward"}

# name: (config, model, rows, (replicas, stages, model axis), optimizer, tolerance,
#        distinct stage functions)
CASES = {
    # Heterogeneous stages from named scopes, 4 nested data-parallel replicas.
    "scopes_2_stages_1f1b": ({**BACKWARD, "pipeline.num_micro_batch": 4}, TwoStages(), 64,
                             (4, 2, 1), adamw, TOL, 2),
    "scopes_2_stages_gpipe": ({**FORWARD, "pipeline.num_micro_batch": 4}, TwoStages(), 64,
                              (4, 2, 1), adamw, TOL, 2),
    # Identical stages from set_default_strategy calls (EPL's BERT example): the two middle
    # stages share one branch of the switch.
    "stack_4_stages_1f1b": ({**BACKWARD, "pipeline.num_micro_batch": 8}, Stack(stages=4), 64,
                            (2, 4, 1), adamw, TOL, 3),
    "stack_4_stages_gpipe": ({**FORWARD, "pipeline.num_micro_batch": 6}, Stack(stages=4), 48,
                             (2, 4, 1), lambda: optax.sgd(0.1, momentum=0.9), TOL, 3),
    # replicate(2) stages: each micro batch split over the stage's 2 devices.
    "replicate_2_per_stage": ({**BACKWARD, "pipeline.num_micro_batch": 4},
                              Stack(stages=2, device_count=2), 32, (2, 2, 2), adamw, TOL, 2),
    # A deeper stack, clipped by global norm (equal on packed parameters).
    "deep_stack_clipped": ({**BACKWARD, "pipeline.num_micro_batch": 4},
                           Stack(stages=2, layers=4, width=32), 32, (4, 2, 1),
                           lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)),
                           DEEP_TOL, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_device_reference(case, caplog):
  config, model, rows, (replicas, stages, per_stage), optimizer, tol, distinct = CASES[case]
  epl.init(config)
  trainer, _ = check_matches_reference(model, classification_batch(rows), optimizer(), tol=tol,
                                       caplog=caplog)
  plan = trainer.plan
  assert (plan.num_replicas, plan.num_stages) == (replicas, stages)
  assert dict(plan.mesh.shape) == {"data": replicas, "stage": stages, "model": per_stage}
  assert len(plan.pipeline.branches) == distinct
  kinds = {c.kind for c in plan.collectives}
  assert {"collective-permute", "all-reduce"} <= kinds
