"""Two workers whose devices report different memory plan the same (tests/test_aot.py):

    python -m epljax.launch --num_workers 2 --gpu_per_worker 2 plan_agree.py

Each worker's XLA ``bytes_limit`` is patched to differ (3 GiB on worker 0, 5 GiB on worker 1);
``auto.auto_parallel`` searches the plan. Prints ``PLAN <worker> <limit> <mesh> <features>``.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))   # tests/helpers.py

import epljax as epl  # noqa: E402

epl.init()   # connects the workers before any JAX use

import jax  # noqa: E402
import optax  # noqa: E402

from epljax import chips, io  # noqa: E402
from helpers import MLP, classification_batch, linen_fns  # noqa: E402

chips.local_memory_bytes = lambda devices: (3 if jax.process_index() == 0 else 5) << 30
epl.init({"auto.auto_parallel": True})
init_fn, loss_fn = linen_fns(MLP())
trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
trainer.init(jax.random.key(0), io.process_slice(classification_batch(16)))
plan = trainer.plan
(chosen,) = [row for row in plan.search if row.chosen]
print(f"PLAN {jax.process_index()} {plan.memory_limit} {chosen.mesh_shape} "
      f"{sorted(chosen.features.items())}", flush=True)
