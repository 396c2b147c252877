"""A training job that fails on purpose, for the launcher's fault tests.

    python -m epljax.launch --num_workers 2 --gpu_per_worker 1 faults.py OUT MODE[@WORKER:STEP]

Every worker writes OUT/pid<i> at start and OUT/ready<i> after its first step, then trains a
small MLP (0.2 s apart) until MODE happens on WORKER at STEP:
  raise_before  raises before epl.init()         raise  raises after it, in the loop
  exit          sys.exit(3)                      kill   SIGKILL to itself
  hang          sleeps forever (silently)
  preempt       (every worker) stops when epljax.launch.stop_requested(step), writing
                OUT/stopped<i> with the step, exit 0
  ignore_term   (every worker) trains on whatever the signals
"""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))   # tests/helpers.py

out, spec = sys.argv[1], sys.argv[2]
mode, _, where = spec.partition("@")
victim, _, at = where.partition(":")
me = int(os.environ["EPL_WORKER_INDEX"])
mine = where == "" or int(victim) == me
at = int(at or 0)


def write(name, text):
  with open(os.path.join(out, f"{name}{me}"), "w") as f:
    f.write(str(text))


write("pid", os.getpid())
if mode == "raise_before" and mine:
  time.sleep(1)
  raise RuntimeError("failed before epl.init()")

import epljax as epl  # noqa: E402

epl.init()

import jax  # noqa: E402
import optax  # noqa: E402

from epljax import io  # noqa: E402
from epljax.launch import stop_requested  # noqa: E402
from helpers import MLP, classification_batch, linen_fns  # noqa: E402

epl.set_default_strategy(epl.replicate(1))
init_fn, loss_fn = linen_fns(MLP())
batch = io.process_slice(classification_batch(8))
trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(1e-2))
state = trainer.init(jax.random.key(0), batch)
for step in range(1, 100_000):
  state, metrics = trainer.train_step(state, batch)
  float(metrics["loss"])                 # the step's collectives are done
  if step == 1:
    write("ready", step)
  if mine and step == at:
    print(f"worker {me}: {mode} at step {step}", flush=True)
    if mode == "raise":
      raise ValueError(f"worker {me} failed at step {step}")
    if mode == "exit":
      sys.exit(3)
    if mode == "kill":
      os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hang":
      time.sleep(100_000)
  if mode == "preempt" and stop_requested(step):
    print(f"worker {me}: stopping at step {step}", flush=True)
    write("stopped", step)
    sys.exit(0)
  time.sleep(0.2)
