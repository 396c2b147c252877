"""``python -m epljax.plan`` on an example script for a cluster, timed: the printout and the
verdict that docs/planning.md shows (needs jax's CUDA plugin: ``pip install -e ".[cuda12]"``).

    python bench/plan_cluster.py --topology h100:8x8 -- --size 70b --layout fsdp [--record]

Runs ``examples/llama.py`` (or ``--script``) under ``python -m epljax.plan`` in a fresh process
and records its printout, exit code and wall time (trace + plan + compile for every device of
the topology, on this machine's CPU).
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")   # (this process compiles nothing: no GPU to start)
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import common  # noqa: E402
import records  # noqa: E402

TITLE = "Planning for a cluster"


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  cut = argv.index("--") if "--" in argv else len(argv)
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--topology", default="h100:8x8")
  parser.add_argument("--script", default="examples/llama.py")
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args(argv[:cut])
  script_args = argv[cut + 1:]
  command = [sys.executable, "-m", "epljax.plan", args.script, "--topology", args.topology,
             "--", *script_args]
  start = time.perf_counter()
  done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
  seconds = time.perf_counter() - start
  printout = done.stdout.rstrip()
  print(printout)
  print(done.stderr[-2000:], file=sys.stderr)
  verdict = {0: "fits", 1: "does not fit"}.get(done.returncode, f"failed ({done.returncode})")
  table = common.table(["topology", "script", "exit code", "verdict", "wall s (2-core CPU)"],
                       [[args.topology, " ".join([args.script, *script_args]),
                         done.returncode, verdict, f"{seconds:.0f}"]])
  print(table)
  if args.record:
    shown = " ".join(["python", "-m", "epljax.plan", args.script, "--topology", args.topology,
                      "--", *script_args])
    chip, _, shape = args.topology.partition(":")
    count = 1
    for n in shape.split("x"):
      count *= int(n)
    key = records.record_key(TITLE, " ".join(["bench/plan_cluster.py", *argv]),
                             f"{count} compile-only {chip.upper()}s")
    records.write(key, datetime.date.today().isoformat(),
                  f"Machine: {common.machine()}  \nCommand: `{shown}`\n\n{table}\n\n"
                  f"### printout\n\n```text\n{printout}\n```\n")
  return 0 if done.returncode in (0, 1) else done.returncode


if __name__ == "__main__":
  sys.exit(main())
