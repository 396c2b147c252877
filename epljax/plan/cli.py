"""``python -m epljax.plan``: an unchanged training script planned for a cluster.

    python -m epljax.plan examples/llama.py --topology h100:8x8 -- --size 70b

runs the script on this machine with ``epl.init`` planning for the topology's compile-only
devices (``epl.topology``) until its first ``trainer.init(rng, batch)``, which compiles the step
for them instead of creating state (``trainer.compile``), and prints the plan, its verdict
first. While the script runs, ``jax.devices()`` and ``jax.device_count()`` are the topology's,
so a script that sizes its batch from them sizes it for the cluster; this one process stands
for every host, so the batch the script makes is the global batch. MaxText's
``train_compile.py`` does the compile for TPU slices; this adds the plan.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
import time
import traceback
from collections.abc import Iterator, Sequence

USAGE = ("python -m epljax.plan SCRIPT --topology KIND:HOSTSxPER_HOST [--memory-limit GIB] "
         "[--full] [--suggest] [--] [ARGS...]")

# The exit codes: what a shell script or CI job branches on.
FITS, DOES_NOT_FIT, NEVER_PLANNED, SCRIPT_RAISED, TOOL_FAILED = 0, 1, 2, 3, 4
EXIT_CODES = f"""\
exit codes:
  {FITS}  the plan fits the devices' memory
  {DOES_NOT_FIT}  it does not fit (the verdict names the cheapest changes that would)
  {NEVER_PLANNED}  the script ended, or called sys.exit, before its first trainer.init
  {SCRIPT_RAISED}  the script raised, before or in trainer.init (its traceback is printed)
  {TOOL_FAILED}  epljax.plan itself failed: bad arguments, a topology it cannot make (an
     unknown kind, jax's CUDA plugin missing), or an error of its own"""


class _Parser(argparse.ArgumentParser):
  def error(self, message: str):   # (argparse's 2 would read as "never reached trainer.init")
    self.print_usage(sys.stderr)
    self.exit(TOOL_FAILED, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
  args, script_args = _parse(sys.argv[1:] if argv is None else list(argv))
  os.environ.setdefault("JAX_PLATFORMS", "cpu")   # nothing runs on a GPU: compile on the CPU
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  try:
    devices = _devices(args.topology)
  except Exception as e:   # (an EPLError, or jax failing to make the devices)
    print(f"epljax.plan: {e}", file=sys.stderr)
    return TOOL_FAILED
  import jax

  from epljax import env as env_lib
  from epljax import train

  limit = str(int(args.memory_limit * (1 << 30))) if args.memory_limit else None
  start = time.perf_counter()
  planned = None
  with env_lib.planning_for(devices), train.stop_at_init(), _devices_are(devices, jax), \
       _argv([args.script, *script_args]), _environ("EPL_AUTO_MEMORY_LIMIT", limit):
    try:
      runpy.run_path(args.script, run_name="__main__")
    except train.Planned as done:
      planned = done
    except SystemExit as e:   # the script exited before its first trainer.init
      print(f"epljax.plan: {args.script} exited (sys.exit({e.code!r})) before calling "
            "trainer.init(rng, batch): nothing to plan.", file=sys.stderr)
      return NEVER_PLANNED
    except Exception as e:
      _print_script_traceback(e)
      print(f"epljax.plan: {args.script} raised {type(e).__name__} before its plan was made "
            "(the traceback above).", file=sys.stderr)
      return SCRIPT_RAISED
  if planned is None:
    print(f"epljax.plan: {args.script} ended without calling trainer.init(rng, batch): "
          "nothing to plan. Run a training script that builds an epl.Trainer and calls "
          "trainer.init.", file=sys.stderr)
    return NEVER_PLANNED
  plan = planned.plan
  if args.suggest and not plan.fits:
    plan.suggestions(compile=True)   # (the verdict then shows their compiled bytes)
  print(plan.format(full=args.full))
  took = time.perf_counter() - start
  print(f"\nepljax.plan: {len(devices)} x {devices[0].device_kind} in "
        f"{_hosts(devices)}: "
        + ("fits" if plan.fits else "DOES NOT FIT") + f" ({took:.0f} s to trace, plan and "
        "compile)")
  return FITS if plan.fits else DOES_NOT_FIT


def run() -> int:
  """``python -m epljax.plan``: ``main``, with an error of the tool's own (a bug, not the
  script's: the script's errors exit 3) exiting 4 instead of Python's 1, which means "does
  not fit"."""
  try:
    return main()
  except SystemExit:
    raise
  except Exception:
    traceback.print_exc()
    print("epljax.plan: failed (the traceback above is epljax's, not the script's).",
          file=sys.stderr)
    return TOOL_FAILED


def _devices(spec: str) -> list:
  """``--topology``: compile-only devices (``epljax.mesh.topology.parse``), or ``cpu:N``, N
  of this machine's CPU devices (more made with XLA's host device count when jax is not
  started yet): the script planned on the machine at hand, no plugin needed."""
  kind, _, shape = spec.partition(":")
  if kind.lower() != "cpu":
    from epljax.mesh import topology
    return topology.parse(spec)
  from epljax.errors import ConfigError
  parts = shape.lower().split("x") if shape else ["1"]
  if len(parts) > 2 or not all(p.isdigit() and int(p) > 0 for p in parts) or (
      len(parts) == 2 and parts[0] != "1"):
    raise ConfigError(f"--topology {spec!r}: CPU devices are one host's; write cpu:N (N "
                      "devices of this machine), for example cpu:8.")
  n = int(parts[-1])
  import jax
  from jax._src import xla_bridge
  flags = os.environ.get("XLA_FLAGS", "")
  if not xla_bridge.backends_are_initialized() and "host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
  cpus = jax.devices("cpu")
  if len(cpus) < n:
    raise ConfigError(f"--topology {spec!r}: this process has {len(cpus)} CPU devices; set "
                      f"XLA_FLAGS=--xla_force_host_platform_device_count={n} or ask for fewer.")
  return cpus[:n]


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  parser = _Parser(prog="python -m epljax.plan", usage=USAGE, epilog=EXIT_CODES,
                   description="An unchanged training script planned for a cluster: run until "
                   "its first trainer.init, the step compiled for the topology's devices, the "
                   "plan printed, its verdict first.",
                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("script", help="the training script (.py), run unchanged")
  parser.add_argument("--topology", required=True,
                      help="KIND:HOSTSxPER_HOST, e.g. h100:8x8 (64 H100s in 8 hosts; needs "
                      "jax's CUDA plugin), or cpu:N (N CPU devices of this machine)")
  parser.add_argument("--memory-limit", type=float, default=0.0,
                      help="GiB per device the plan must fit (default: the chip's memory)")
  parser.add_argument("--full", action="store_true",
                      help="one variables row per leaf (default: a stack of layers a row)")
  parser.add_argument("--suggest", action="store_true",
                      help="when it does not fit, compile the changes that would and show "
                      "their compiled bytes per device (default: the search's estimates)")
  if "--" in argv:   # everything after -- belongs to the script
    cut = argv.index("--")
    args, rest = parser.parse_known_args(argv[:cut])
    return args, rest + argv[cut + 1:]
  return parser.parse_known_args(argv)


def _print_script_traceback(error: BaseException) -> None:
  """The script's traceback, without this module's and runpy's frames above it."""
  tb = error.__traceback__
  while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
                            or "runpy" in tb.tb_frame.f_code.co_filename):   # (<frozen runpy>)
    tb = tb.tb_next
  traceback.print_exception(type(error), error, tb)


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
def _environ(name: str, value: str | None) -> Iterator[None]:
  """``os.environ[name]`` is ``value`` while inside (unchanged for None)."""
  saved = os.environ.get(name)
  if value is not None:
    os.environ[name] = value
  try:
    yield
  finally:
    if value is not None:
      if saved is None:
        del os.environ[name]
      else:
        os.environ[name] = saved


@contextlib.contextmanager
def _argv(argv: list[str]) -> Iterator[None]:
  """``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT ARGS`` sets them (runpy sets neither)."""
  saved, sys.argv = sys.argv, argv
  folder = os.path.dirname(os.path.abspath(argv[0]))
  sys.path.insert(0, folder)
  try:
    yield
  finally:
    sys.argv = saved
    if folder in sys.path:
      sys.path.remove(folder)


def _hosts(devices: list) -> str:
  n = len({d.process_index for d in devices})
  return f"{n} host" + ("s" if n > 1 else "")
