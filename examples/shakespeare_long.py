"""The Shakespeare GPT on rows of 1024 characters, each row split over 4 devices (context
parallelism), its loss checked against one device's.

    python examples/shakespeare_long.py --context 4 --seq 1024
    python examples/shakespeare_long.py --context 4 --seq 1024 --steps 200 --check

The model is ``shakespeare_char.py``'s nanoGPT "baby GPT" (4 layers, 4 heads, width 128) with
its attention through ``epl.nn.dot_product_attention`` (``GPTConfig(attention="epl")``) and a
context of ``--seq`` characters instead of 64. ``epl.init({"context.parallel_degree": 4})``
adds a mesh axis ``context`` of 4 devices: each batch leaf's dimension 1, the sequence, is split
over it (device ``c`` holds characters ``c * seq/4 .. (c+1) * seq/4 - 1`` of every row), the
attention runs over the axis (keys and values travel around a ring, causal work balanced
inside it), and everything else follows GSPMD. The model does not change: its positions are
still ``jnp.arange(seq)``.

``--check`` trains the same steps from the same initial parameters on the same batches on one
device (plain ``jax.jit``, no epljax) and prints both losses; they agree to float32 rounding.
Batches are random windows of the training 90% of the repository's tiny Shakespeare
(``examples/data/tinyshakespeare.txt``), drawn with numpy (no data pipeline to install):
inputs ``x`` and next characters ``y``, ``--batch`` rows (global) of ``--seq`` each.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import epljax as epl  # noqa: E402
from epljax.data import CharVocab, split_train_val  # noqa: E402
from shakespeare_char import GPT, GPTConfig, optimizer, read_text  # noqa: E402


def loss_fn(model, variables, batch):
  """Mean next-character cross entropy (``x`` and ``y`` both ``[rows, seq]``: the sequence
  dimension divides over the devices)."""
  logits = model.apply(variables, batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def batches(tokens: np.ndarray, seq: int, rows: int, seed: int):
  """Random windows ``{"x": [rows, seq], "y": the next characters}``, seeded."""
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(tokens) - seq - 1, rows)
    window = np.stack([tokens[s:s + seq + 1] for s in starts]).astype(np.int32)
    yield {"x": window[:, :-1], "y": window[:, 1:]}


def one_device(model, opt, init_fn, data, steps: int, seed: int) -> list[float]:
  """The reference: the same steps with plain ``jax.jit`` on one device."""
  device = jax.devices()[0]
  first = next(data)
  params = jax.device_put(init_fn(jax.random.key(seed), first)["params"], device)
  state = (params, opt.init(params))

  @jax.jit
  def step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(lambda p: loss_fn(model, {"params": p}, batch))(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  losses = []
  for batch in [first, *(next(data) for _ in range(steps - 1))]:
    state, loss = step(state, jax.device_put(batch, device))
    losses.append(float(loss))
  return losses, {"params": state[0]}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--context", type=int, default=4, help="context.parallel_degree")
  parser.add_argument("--data_parallel", type=int, default=1,
                      help="data-parallel replicas beside it (devices = this x --context)")
  parser.add_argument("--seq", type=int, default=1024, help="characters per row")
  parser.add_argument("--batch", type=int, default=8, help="rows per step, all devices")
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--width", type=int, default=128, help="n_embd (4 heads)")
  parser.add_argument("--log_interval", type=int, default=10)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--check", action="store_true", help="train on one device too, compare")
  parser.add_argument("--plan", action="store_true", help="print the parallel plan")
  args = parser.parse_args(argv)

  text = read_text()
  vocab = CharVocab.of(text)
  train_tokens, _ = split_train_val(vocab.encode(text))
  cfg = GPTConfig(vocab_size=len(vocab), block_size=args.seq, n_layer=args.layers,
                  n_embd=args.width, attention="epl")
  model = GPT(cfg)
  opt = optimizer(steps=max(args.steps, 2), warmup=min(100, args.steps // 10))
  init_fn = lambda key, batch: model.init(key, batch["x"][:1])  # noqa: E731

  devices = args.context * args.data_parallel
  epl.init({"cluster.run_visible_devices": ",".join(map(str, range(devices))),
            "context.parallel_degree": args.context})
  epl.set_default_strategy(epl.replicate(1))
  trainer = epl.Trainer(init_fn, lambda v, b: loss_fn(model, v, b), opt)
  data = batches(train_tokens, args.seq, args.batch, args.seed)
  first = next(data)
  state = trainer.init(jax.random.key(args.seed), first)
  plan = str(trainer.plan)
  if args.plan:
    print(plan, "\n")
  losses = []
  for i, batch in enumerate([first, *(next(data) for _ in range(args.steps - 1))]):
    state, metrics = trainer.train_step(state, batch)
    losses.append(float(metrics["loss"]))
    if args.log_interval and (i + 1) % args.log_interval == 0:
      print(f"step {i + 1}: loss {losses[-1]:.4f}")
  result = {"losses": losses, "variables": trainer.variables(state), "plan": plan}
  print(f"context {args.context} x data {args.data_parallel}, {args.seq} characters a row: "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
  if args.check:
    reference, variables = one_device(model, opt, init_fn,
                                      batches(train_tokens, args.seq, args.batch, args.seed),
                                      args.steps, args.seed)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    print(f"one device: loss {reference[0]:.4f} -> {reference[-1]:.4f}; largest relative "
          f"difference of the {args.steps} losses: {worst:.1e}")
    result.update(reference=reference, reference_variables=variables)
  return result


if __name__ == "__main__":
  main()
