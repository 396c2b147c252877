"""A training run that checkpoints, resumes and stops at preemption (tests/test_checkpoint.py,
tests/test_preemption.py). Prints ``LOSS <step> <loss>`` per step (step counted from 1),
``RESUMED <step>`` when it restored, ``PREEMPTED <step>`` when it saved for a SIGTERM.

    python tests/launch_scripts/ckpt_worker.py --dir /tmp/run --steps 8 --every 2
"""

import argparse
import os
import sys
import time

import flax.linen as nn
import jax
import numpy as np
import optax

import epljax as epl


class Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(10)(nn.relu(nn.Dense(32)(x)))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--dir", required=True)
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--every", type=int, default=2, help="save every this many steps")
  parser.add_argument("--sleep", type=float, default=0.0, help="seconds after each step")
  args = parser.parse_args()

  epl.init()
  epl.set_default_strategy(epl.replicate(1))
  model = Net()
  trainer = epl.Trainer(
      lambda rng, b: model.init(rng, b["x"]),
      lambda v, b: optax.softmax_cross_entropy_with_integer_labels(
          model.apply(v, b["x"]), b["y"]).mean(),
      optax.adam(1e-2))
  rows = 8 * jax.device_count()

  def batch_at(step):   # the global batch of a step, then this process's rows
    rng = np.random.default_rng(step)
    batch = {"x": rng.normal(size=(rows, 20)).astype(np.float32),
             "y": rng.integers(0, 10, rows).astype(np.int32)}
    return epl.io.process_slice(batch)

  state = trainer.init(jax.random.key(0), batch_at(0))
  ckpt = epl.Checkpointer(args.dir, max_to_keep=3)
  start = 0
  if ckpt.latest_step() is not None:
    state = ckpt.restore(trainer)
    start = int(state.step)
    print(f"RESUMED {start}", flush=True)
  for step in range(start, args.steps):
    state, metrics = trainer.train_step(state, batch_at(step))
    done = step + 1
    print(f"LOSS {done} {float(metrics['loss']).hex()}", flush=True)
    preempted = ckpt.reached_preemption(done)
    if done % args.every == 0 or preempted:
      ckpt.save(done, state)
    if preempted:
      ckpt.wait()
      print(f"PREEMPTED {done}", flush=True)
      sys.exit(0)
    time.sleep(args.sleep)
  ckpt.wait()
  print(f"DONE {os.getpid()}", flush=True)


if __name__ == "__main__":
  main()
