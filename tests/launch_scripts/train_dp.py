"""A data-parallel job for the launcher tests: python -m epljax.launch ... train_dp.py OUT.json

Every worker builds the same global batch, keeps its rows (epljax.io.process_slice) and trains
3 steps; worker 0 writes the cluster facts, the losses and the final parameters to OUT.json.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))   # tests/helpers.py

import epljax as epl  # noqa: E402

env = epl.init()                      # connects the workers (jax.distributed) before any JAX use
env = epl.init({"pipeline.num_micro_batch": 1})    # a second init: no second connection

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from epljax import io  # noqa: E402
from helpers import MLP, classification_batch, linen_fns  # noqa: E402

epl.set_default_strategy(epl.replicate(1))
init_fn, loss_fn = linen_fns(MLP())
global_batch = classification_batch(32)
trainer = epl.Trainer(init_fn, loss_fn, optax.adamw(1e-2))
state = trainer.init(jax.random.key(0), io.process_slice(global_batch))
mine = io.process_slice(global_batch, trainer.plan)
losses = []
for _ in range(3):
  state, metrics = trainer.train_step(state, mine)
  losses.append(float(metrics["loss"]))
params = jax.tree.map(lambda x: np.asarray(x).tolist(), trainer.variables(state)["params"])
c = env.cluster
print(f"worker {c.worker_index}: losses {losses}", flush=True)
if c.worker_index == 0:
  with open(sys.argv[1], "w") as f:
    json.dump({"cluster": [c.worker_num, c.worker_index, c.total_gpu_num, c.local_device_count],
               "replicas": trainer.plan.num_replicas, "losses": losses, "params": params}, f)
