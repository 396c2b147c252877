"""The baby GPT of ``examples/shakespeare_char.py`` (dp) on tiny Shakespeare, checkpointing
its Grain iterator with the state and resuming both (tests/test_shakespeare.py). Prints
``LOSS <step> <loss>`` and ``DATA <step> <first characters of the batch's windows>`` per step
(step counted from 1) and ``RESUMED <step>`` when it restored.

    python tests/launch_scripts/shakespeare_resume.py --dir /tmp/run --steps 8 --every 2
"""

import argparse
import os
import sys
import time

import jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

import epljax as epl  # noqa: E402
import shakespeare_char as sc  # noqa: E402
from epljax.data import CharVocab, split_train_val, windows  # noqa: E402


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--dir", required=True)
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--every", type=int, default=2, help="save every this many steps")
  parser.add_argument("--sleep", type=float, default=0.0, help="seconds after each step")
  args = parser.parse_args()

  text = sc.read_text()      # the repository's tiny Shakespeare
  vocab = CharVocab.of(text)
  train_tokens, _ = split_train_val(vocab.encode(text))
  epl.init({"cluster.run_visible_devices": "0,1,2,3"})
  epl.set_default_strategy(epl.replicate(1))
  model = sc.GPT(sc.GPTConfig(vocab_size=len(vocab)))
  trainer = epl.Trainer(lambda key, b: model.init(key, b["tokens"][:1, :-1]),
                        lambda v, b: sc.loss_fn(model, v, b), sc.optimizer())
  dataset = windows(train_tokens, 64, sc.BATCH // jax.process_count(), seed=0)
  data = iter(dataset)
  state = trainer.init(jax.random.key(0), next(iter(dataset)))
  ckpt = epl.Checkpointer(args.dir, max_to_keep=3)
  start = 0
  if ckpt.latest_step() is not None:
    state = ckpt.restore(trainer, data=data)
    start = int(state.step)
    print(f"RESUMED {start}", flush=True)
  for step in range(start, args.steps):
    batch = next(data)
    state, metrics = trainer.train_step(state, batch)
    done = step + 1
    print(f"DATA {done} {vocab.decode(batch['tokens'][:, 0])!r}", flush=True)
    print(f"LOSS {done} {float(metrics['loss'])!r}", flush=True)
    if done % args.every == 0:
      ckpt.save(done, state, data=data)
    time.sleep(args.sleep)
  ckpt.wait()


if __name__ == "__main__":
  main()
