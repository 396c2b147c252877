"""What each strategy communicates: collectives and bytes read from the compiled HLO, beside
the analytic minimum.

    python bench/comm.py            # print the strategies' table
    python bench/comm.py --record   # and replace its section in bench/RESULTS.md
    python bench/comm.py --zoo [--record]   # the zoo models split with their one annotate rule

The zoo table trains nothing: each model of ``tests/models`` is split over 2 devices with the
one ``epl.annotate`` rule a user would write (4 replicas on 8 devices), and its compiled train
step is compared with Megatron's minimum (``megatron_minimum``).

For each case the forward pass alone (``Trainer.lower_loss``) and the whole train step
(``Trainer.lower``) are compiled on 8 simulated CPU devices; "bytes" are the result bytes of
each collective on one device.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS") or "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(__file__))
# This checkout's epljax, not an installed one (a worktree beside an editable install).
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import argparse  # noqa: E402
import contextlib  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import epljax as epl  # noqa: E402
from common import machine, record, table  # noqa: E402
from epljax import hlo  # noqa: E402
from epljax.nn import MoE, softmax_cross_entropy_with_integer_labels  # noqa: E402

ROWS, LENGTH, WIDTH = 32, 64, 256

# Megatron's minimum for each zoo model, from its structure: (row-split matmuls, i.e. attention
# outputs and MLP down projections; whether the embedding and the logits are
# vocabulary-parallel; tokens per row; activation width).
ZOO_SHAPES = {
    "gemma": lambda m: (2 * m.gemma.LAYERS, True, 16, m.gemma.D_MODEL),
    "llama": lambda m: (2 * m.llama.LAYERS, True, 16, m.llama.D_MODEL),
    "gpt2": lambda m: (2 * m.gpt2.LAYERS, True, m.gpt2.LENGTH, m.gpt2.D_MODEL),
    "gpt2_fused": lambda m: (2 * m.gpt2_fused.LAYERS, True, m.gpt2.LENGTH, m.gpt2.D_MODEL),
    "gpt2_fused_t": lambda m: (2 * m.gpt2_fused.LAYERS, True, m.gpt2.LENGTH, m.gpt2.D_MODEL),
    "vit": lambda m: (2 * m.vit.LAYERS, False, m.vit.TOKENS, m.vit.D_MODEL),
    "mlp_loop": lambda m: (m.mlp_loop.DEPTH, False, 1, m.mlp_loop.WIDTH),
}
ZOO_ROWS, ZOO_SPLIT = 8, 2


def megatron_minimum(name: str, rows_per_replica: int, gradient_bytes: int,
                     forward_only: bool = False) -> dict[str, int]:
  """Megatron's collectives for one train step (or its forward) of zoo model ``name``, tensor
  arrays only.

  Forward: one all-reduce of the activations after each row-split matmul, and one after the
  vocabulary-parallel embedding lookup; the vocabulary-parallel cross entropy reduces three
  per-token rows (max, sum of exponentials, target logit). Backward: one all-reduce of the
  input gradient of each column-split region (q/k/v together, the MLP's up and gate
  together), one for the vocabulary-parallel logits matmul (the softmax's gradient is local
  once the forward's rows are known). Data parallelism adds one all-reduce of this
  device's gradients (``gradient_bytes``; 0 with one replica).
  """
  import models

  row_matmuls, vocab, tokens, width = ZOO_SHAPES[name](models)
  activation = rows_per_replica * tokens * width * 4
  per_token = rows_per_replica * tokens * 4
  arrays = (row_matmuls + vocab) * (1 if forward_only else 2)
  rows = 3 * vocab
  return {"activation arrays": arrays,
          "bytes": arrays * activation + rows * per_token
          + (0 if forward_only else gradient_bytes)}


def tensor_bytes(found) -> int:
  """Result bytes of the collectives' non-scalar arrays (scalars: the loss, norms)."""
  return sum(c.bytes for c in found) - sum(
      hlo._nbytes(shape[:-2], "") for c in found for shape in c.shapes if shape.endswith("[]"))


def activation_arrays(found, shape: str) -> int:
  return sum(c.shapes.count(shape) for c in found)


def zoo_split(name: str, devices: int = ZOO_SPLIT, rows: int = ZOO_ROWS, optimizer=None):
  """(trainer, state, batch) of zoo model ``name`` split with its one annotate rule, trained by
  ``optimizer`` (default: SGD, 0.1)."""
  import models

  zoo = models.ZOO[name]
  epl.init()
  epl.annotate(zoo.annotate_rules(devices))
  batch = zoo.make_batch(rows)
  trainer = epl.Trainer(zoo.init_fn, zoo.loss_fn, optimizer or optax.sgd(0.1))
  rules = (nn.logical_axis_rules(zoo.logical_rules) if zoo.logical_rules
           else contextlib.nullcontext())
  with rules:
    state = trainer.init(jax.random.key(0), batch)
  return trainer, state, batch


def zoo_row(name: str) -> list:
  import models

  try:
    trainer, state, batch = zoo_split(name)
  except Exception as e:  # noqa: BLE001 (the table says which model fails and why)
    return [name, f"fails: {type(e).__name__}: {str(e).splitlines()[0][:70]}", "", "", "", ""]
  plan = trainer.plan
  per_replica = ZOO_ROWS // plan.num_replicas
  _, _, tokens, width = ZOO_SHAPES[name](models)
  act = f"f32[{per_replica},{tokens},{width}]" if tokens > 1 else f"f32[{per_replica},{width}]"
  grads = plan.param_bytes if plan.num_replicas > 1 else 0
  row = [name]
  for forward in (True, False):
    lowered = trainer.lower_loss(state, batch) if forward else trainer.lower(state, batch)
    found = hlo.executed_collectives(lowered.compile().as_text())
    minimum = megatron_minimum(name, per_replica, grads, forward_only=forward)
    measured = tensor_bytes(found)
    row += [summary(found), f"{activation_arrays(found, act)} / {minimum['activation arrays']}",
            f"{measured / 2**10:.1f} / {minimum['bytes'] / 2**10:.1f} = "
            f"**{measured / minimum['bytes']:.2f}**"]
  return row[:1] + row[2:4] + row[5:]


class DataParallelMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(WIDTH)(nn.relu(nn.Dense(4 * WIDTH)(x)))


class MegatronMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    with epl.split(8, name="mlp"):
      return nn.Dense(WIDTH, name="wo")(nn.relu(nn.Dense(4 * WIDTH, name="wi")(x)))


class Classifier(nn.Module):
  classes: int

  @nn.compact
  def __call__(self, x):
    with epl.replicate(8, name="features"):
      x = nn.relu(nn.Dense(WIDTH)(x))
    with epl.split(8, name="classifier"):
      return nn.Dense(self.classes, name="fc")(x)


class MoELayer(nn.Module):
  @nn.compact
  def __call__(self, x):
    y, _ = MoE(8, 4 * WIDTH, top_k=2, experts=epl.split(8, name="experts"))(x)
    return y


def summary(found) -> str:
  counts = hlo.summarize(found)
  return ", ".join(f"{n} {k} ({b / 2**10:.0f} KiB)" for k, (n, b) in counts.items()) or "none"


def run(name, model, batch, loss_of, config, default=None, minimum=""):
  epl.init(config)
  if default is not None:
    epl.set_default_strategy(default)

  def loss_fn(variables, b):
    return loss_of(model.apply(variables, b["x"]), b)

  trainer = epl.Trainer(lambda key, b: model.init(key, b["x"]), loss_fn, optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), batch)
  forward = hlo.collectives(trainer.lower_loss(state, batch).compile().as_text())
  step = trainer.plan.collectives
  return [name, dict(trainer.plan.mesh.shape).__repr__().replace("'", ""), summary(forward),
          summary(step), minimum]


def zoo_table() -> str:
  import models

  rows = [zoo_row(name) for name in models.ZOO]
  return (table(["zoo model", "forward: activation arrays / min", "forward KiB / min = ratio",
                 "step: activation arrays / min", "step KiB / min = ratio"], rows)
          + f"\n\nEach model split over {ZOO_SPLIT} devices with its one epl.annotate rule, "
          f"{8 // ZOO_SPLIT} replicas, {ZOO_ROWS} rows per step. Bytes: result bytes per device "
          "of every non-scalar array of every collective in the compiled step; minimum: "
          "bench/comm.py megatron_minimum.")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--classes", type=int, default=100_000)
  parser.add_argument("--record", action="store_true")
  parser.add_argument("--zoo", action="store_true", help="the zoo table instead")
  args = parser.parse_args(argv)
  if args.zoo:   # its own section (the plain run's record would key it by another command)
    zoo = zoo_table()
    print(f"{machine()}\n\n{zoo}")
    if args.record:
      record("Split zoo models vs Megatron's minimum (bench/comm.py)", zoo, argv)
    return
  rng = np.random.default_rng(0)
  tokens = {"x": rng.normal(size=(ROWS, LENGTH, WIDTH)).astype(np.float32)}
  rows = {"x": rng.normal(size=(256, WIDTH)).astype(np.float32),
          "y": rng.integers(0, args.classes, 256).astype(np.int32)}
  mse = lambda out, b: ((out - b["x"]) ** 2).mean()  # noqa: E731
  act = ROWS * LENGTH * WIDTH * 4
  params_mlp = (WIDTH * 4 * WIDTH * 2 + 5 * WIDTH) * 4
  colocate = {"cluster.colocate_split_and_replicate": True}
  capacity = -(-LENGTH * 2 * 5 // (4 * 8))   # MoE's ceil(tokens * top_k * 1.25 / experts)
  a2a = 8 * (ROWS // 8) * capacity * WIDTH * 4
  cases = [
      run("data parallel MLP", DataParallelMLP(), tokens, mse, {},
          minimum=f"forward none; step 1 all-reduce of the gradients ({params_mlp // 1024} KiB)"),
      run("split(8) Megatron MLP", MegatronMLP(), tokens, mse, {},
          minimum=f"forward 1 all-reduce of the activations ({act // 1024} KiB)"),
      run(f"split(8) classifier, {args.classes} classes, integer-label CE",
          Classifier(args.classes), rows,
          lambda out, b: optax.softmax_cross_entropy_with_integer_labels(out, b["y"]).mean(),
          colocate, minimum="no gather of logits or kernel"),
      run(f"split(8) classifier, {args.classes} classes, epl.nn CE",
          Classifier(args.classes), rows,
          lambda out, b: softmax_cross_entropy_with_integer_labels(out, b["y"]).mean(),
          colocate, minimum="gather features (256 KiB), row sums only"),
      run("MoE layer, experts split(8)", MoELayer(), tokens, mse, colocate,
          default=epl.replicate(8),
          minimum=f"forward 2 all-to-all per layer ({a2a // 1024} KiB each)"),
  ]
  body = (table(["case", "mesh", "forward (compiled)", "train step (compiled)",
                 "analytic minimum"], cases)
          + f"\n\nTokens {ROWS}x{LENGTH}x{WIDTH} float32; classifier batch 256 x {WIDTH}. "
          "Counts and result bytes per device, from the compiled HLO.")
  print(f"{machine()}\n\n{body}")
  if args.record:
    record("Communication per strategy (bench/comm.py)", body, argv)


if __name__ == "__main__":
  main()
