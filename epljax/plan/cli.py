"""``python -m epljax.plan``: an unchanged training script planned for a cluster.

    python -m epljax.plan examples/llama.py --topology h100:8x8 -- --size 70b

runs the script on this machine with ``epl.init`` planning for the topology's compile-only
devices (``epl.topology``) until its first ``trainer.init(rng, batch)``, which compiles the step
for them instead of creating state (``trainer.compile``); prints the plan and exits 0 when it
fits the devices' memory, 1 when it does not (2 when the script never reached
``trainer.init``). While the script runs, ``jax.devices()`` and ``jax.device_count()`` are the
topology's, so a script that sizes its batch from them sizes it for the cluster; this one
process stands for every host, so the batch the script makes is the global batch.
MaxText's ``train_compile.py`` does the compile for TPU slices; this adds the plan.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
import time
from collections.abc import Iterator, Sequence

USAGE = ("python -m epljax.plan SCRIPT --topology KIND:HOSTSxPER_HOST [--memory-limit GIB] "
         "[--] [ARGS...]")


def main(argv: Sequence[str] | None = None) -> int:
  args, script_args = _parse(sys.argv[1:] if argv is None else list(argv))
  os.environ.setdefault("JAX_PLATFORMS", "cpu")   # nothing runs on a GPU: compile on the CPU
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  import jax

  from epljax import env as env_lib
  from epljax import train
  from epljax.errors import EPLError
  from epljax.mesh import topology

  try:
    devices = topology.parse(args.topology)
  except EPLError as e:
    print(f"epljax.plan: {e}", file=sys.stderr)
    return 2
  if args.memory_limit:
    os.environ["EPL_AUTO_MEMORY_LIMIT"] = str(int(args.memory_limit * (1 << 30)))
  start = time.perf_counter()
  planned = None
  with env_lib.planning_for(devices), train.stop_at_init(), _devices_are(devices, jax), \
       _argv([args.script, *script_args]):
    try:
      runpy.run_path(args.script, run_name="__main__")
    except train.Planned as done:
      planned = done
    except SystemExit as e:   # the script exited before its first trainer.init
      if e.code not in (None, 0):
        raise
  if planned is None:
    print(f"epljax.plan: {args.script} ended without calling trainer.init(rng, batch): "
          "nothing to plan. Run a training script that builds an epl.Trainer and calls "
          "trainer.init.", file=sys.stderr)
    return 2
  plan = planned.plan
  print(plan)
  fits = plan.fits
  took = time.perf_counter() - start
  print(f"\nepljax.plan: {len(devices)} x {devices[0].device_kind} in "
        f"{len({d.process_index for d in devices})} hosts: "
        + ("fits" if fits else "DOES NOT FIT") + f" ({took:.0f} s to trace, plan and compile)")
  return 0 if fits else 1


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  parser = argparse.ArgumentParser(prog="python -m epljax.plan", usage=USAGE,
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("script", help="the training script (.py), run unchanged")
  parser.add_argument("--topology", required=True,
                      help="KIND:HOSTSxPER_HOST, e.g. h100:8x8 (64 H100s in 8 hosts)")
  parser.add_argument("--memory-limit", type=float, default=0.0,
                      help="GiB per device the plan must fit (default: the chip's memory)")
  if "--" in argv:   # everything after -- belongs to the script
    cut = argv.index("--")
    args, rest = parser.parse_known_args(argv[:cut])
    return args, rest + argv[cut + 1:]
  return parser.parse_known_args(argv)


@contextlib.contextmanager
def _devices_are(devices: list, jax) -> Iterator[None]:
  """``jax.devices()`` / ``jax.device_count()`` / ``jax.local_device_count()`` answer with the
  topology's devices while the script runs (epljax itself reads ``epl.init``'s devices)."""
  saved = jax.devices, jax.device_count, jax.local_device_count
  per_host = sum(d.process_index == devices[0].process_index for d in devices)
  jax.devices = lambda *a, **k: list(devices)
  jax.device_count = lambda *a, **k: len(devices)
  jax.local_device_count = lambda *a, **k: per_host
  try:
    yield
  finally:
    jax.devices, jax.device_count, jax.local_device_count = saved


@contextlib.contextmanager
def _argv(argv: list[str]) -> Iterator[None]:
  saved, sys.argv = sys.argv, argv
  try:
    yield
  finally:
    sys.argv = saved
