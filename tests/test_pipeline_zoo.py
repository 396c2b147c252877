"""``auto.auto_parallel`` on the model zoo (tests/models): the automatic cut is exact against
single-device training, balances FLOPs and parameters, and holds tied embeddings in every
stage using them (gradients summed)."""

import warnings

import optax
import pytest

import epljax as epl
from epljax.pipeline.auto import StageBalanceWarning, stage_balance
from helpers import DEEP_TOL, TOL
from models import ZOO
from pipeline_helpers import check_matches_reference

# (model, stages, path of the tied embedding or None). Llama-style needs logical axis rules,
# which do not yet trace (tests/models/llama.py: a with_sharding_constraint of the wrong rank
# under nn.scan, outside the pipeline), so it is not here.
# SGD with momentum: Adam turns the rounding noise of gradients that are exactly zero in
# theory (attention key biases) into +-lr steps. (The ViT-style model cuts as well; it is
# left out to keep the suite short.)
CASES = [("gpt2", 4, "params/wte/embedding"), ("gemma", 2, "params/embedder/input_embedding"),
         ("mlp_loop", 4, None)]


@pytest.mark.slow
@pytest.mark.parametrize("name, stages, tied", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_auto_cut_is_exact_balanced_and_keeps_tied_embeddings(name, stages, tied):
  zoo = ZOO[name]
  epl.init({"auto.auto_parallel": True, "pipeline.num_stages": stages,
            "pipeline.num_micro_batch": 4})
  with warnings.catch_warnings():
    warnings.simplefilter("error", StageBalanceWarning)
    trainer, _ = check_matches_reference(
        None, zoo.make_batch(32), optax.sgd(0.05, momentum=0.9), steps=1,
        tol=DEEP_TOL if zoo.deep else TOL, fns=(zoo.init_fn, zoo.loss_fn))
  built = trainer._built
  flops, params = stage_balance(built.capture, built.layout.stage_of, stages)
  assert max(flops) <= 1.5 * sum(flops) / stages and min(flops) > 0, flops
  assert min(params) > 0.5 * sum(params) / stages, params
  pipe = trainer.plan.pipeline
  if tied is None:
    assert pipe.shared == {}
  else:
    assert pipe.shared == {pipe.param_paths.index(tied): (0, stages - 1)}

