"""Multi-process start-up and step time: 2 processes x 4 CPU devices against 1 process x 8.

    python bench/launch.py              # print the table
    python bench/launch.py --record     # and replace its section in bench/RESULTS.md
    python bench/launch.py --faults [--record]   # how fast a failure ends the job

Each round launches the same data-parallel job twice through ``python -m epljax.launch``, once
as 1 worker x 8 CPU devices and once as 2 workers x 4 (gloo over 127.0.0.1), in alternating
order. A worker reports the time from the launcher's start to the end of its first step
(start-up: interpreter, ``jax.distributed``, trace, compile, first step) and the median time of
the following steps. The step-time ratio is taken per round, then its median over rounds.
This file is also the worker (``--worker``).

``--faults`` launches ``tests/launch_scripts/faults.py`` (2 workers that call ``epl.init()`` and
train) with one worker failing at step 3 in each way, and reports the seconds from the failing
worker's last line to the launcher's exit, and what one ``heartbeat()`` (the per-step hook of
``--hang_timeout``) costs.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
# This checkout's epljax, not an installed one (a worktree beside an editable install).
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(out: str, started: float, width: int, depth: int, rows: int, steps: int) -> None:
  import epljax as epl
  epl.init()
  import jax
  import optax

  from common import mlp_problem
  from epljax import io

  model, batch, loss_fn = mlp_problem(width, depth, rows)
  epl.set_default_strategy(epl.replicate(1))
  trainer = epl.Trainer(lambda k, b: model.init(k, b["x"]), loss_fn, optax.adamw(1e-3))
  mine = io.process_slice(batch)
  state = trainer.init(jax.random.key(0), mine)
  state, metrics = trainer.train_step(state, mine)
  jax.block_until_ready(metrics["loss"])
  first = time.time() - started
  local = trainer.shard_batch(mine)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    state, metrics = trainer.train_step(state, local)
    jax.block_until_ready(metrics["loss"])
    times.append(time.perf_counter() - start)
  if jax.process_index() == 0:
    with open(out, "w") as f:
      json.dump({"first_step_s": first, "step_s": statistics.median(times)}, f)


def launch(workers: int, devices: int, args: argparse.Namespace) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "result.json")
    started = time.time()
    cmd = [sys.executable, "-m", "epljax.launch", "--num_workers", str(workers),
           "--gpu_per_worker", str(devices), "--platform", "cpu", os.path.abspath(__file__),
           "--worker", out, str(started), str(args.width), str(args.depth), str(args.rows),
           str(args.steps)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if not k.startswith("EPL_")})
    if done.returncode:
      raise SystemExit(f"launch failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    with open(out) as f:
      return json.load(f)


FAULTS = os.path.join(REPO, "tests", "launch_scripts", "faults.py")


def fault_end_s(spec: str) -> tuple[float, int]:
  """Seconds from the failing worker's announcement to the launcher's exit; its exit status."""
  with tempfile.TemporaryDirectory() as tmp:
    cmd = [sys.executable, "-m", "epljax.launch", "--num_workers", "2", "--gpu_per_worker", "1",
           FAULTS, tmp, spec]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={k: v for k, v in os.environ.items()
                                            if not k.startswith("EPL_")})
    failed_at = None
    for line in proc.stdout:
      if failed_at is None and f"{spec.split('@')[0]} at step" in line:
        failed_at = time.monotonic()
    code = proc.wait(timeout=300)
    if failed_at is None:
      raise SystemExit(f"{spec}: the worker never announced its failure (status {code})")
    return time.monotonic() - failed_at, code


def heartbeat_ns(calls: int = 200_000) -> dict[str, float]:
  """Nanoseconds per ``heartbeat()``: outside the launcher, throttled, and writing each call."""
  import timeit

  from epljax.launch import worker as w
  out = {"outside the launcher": timeit.timeit(w.heartbeat, number=calls) / calls}
  with tempfile.TemporaryDirectory() as tmp:
    w.open_heartbeat({w.HEARTBEAT: os.path.join(tmp, "beat")})
    out[f"launched, throttled to 1 write / {w.HEARTBEAT_EVERY_S} s"] = (
        timeit.timeit(w.heartbeat, number=calls) / calls)
    every, w.HEARTBEAT_EVERY_S = w.HEARTBEAT_EVERY_S, 0.0
    out["launched, one pwrite every call"] = timeit.timeit(w.heartbeat, number=calls) / calls
    w.HEARTBEAT_EVERY_S = every
  return {k: 1e9 * v for k, v in out.items()}


def faults(record: bool) -> None:
  from common import table
  rows = []
  for spec, what in (("raise@1:3", "worker 1 raises"),
                     ("exit@1:3", "worker 1 calls sys.exit(3)"),
                     ("kill@1:3", "worker 1 gets SIGKILL"),
                     ("raise@0:3", "worker 0 (the coordinator) raises")):
    seconds, code = fault_end_s(spec)
    rows.append([what, f"{seconds:.2f}", code])
  body = table(["2 workers; at step 3, after epl.init()", "failure to launcher exit s",
                "launcher status"], rows)
  body += "\n\n" + table(["heartbeat() per step", "ns per call"],
                          [[k, f"{v:.0f}"] for k, v in heartbeat_ns().items()])
  body += ("\n\nBefore: an exception or sys.exit(3) after epl.init() hung the job for 300 s "
           "(JAX's shutdown barrier), then the wrong worker was blamed (status 134).")
  print(body)
  if record:
    from common import record as append
    append("Launcher faults (bench/launch.py --faults)", body)


def main() -> None:
  # (for machine(); an empty XLA_FLAGS counts as unset)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS")
                             or "--xla_force_host_platform_device_count=8")
  p = argparse.ArgumentParser()
  p.add_argument("--record", action="store_true")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--width", type=int, default=512)
  p.add_argument("--depth", type=int, default=2)
  p.add_argument("--rows", type=int, default=512)
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--faults", action="store_true", help="time how failures end the job")
  args = p.parse_args()
  if args.faults:
    return faults(args.record)
  runs = {"1x8": [], "2x4": []}
  for r in range(args.rounds):
    order = [("1x8", 1, 8), ("2x4", 2, 4)]
    for name, workers, devices in order if r % 2 == 0 else order[::-1]:
      runs[name].append(launch(workers, devices, args))
  ratios = [b["step_s"] / a["step_s"] for a, b in zip(runs["1x8"], runs["2x4"])]
  med = lambda xs: statistics.median(xs)  # noqa: E731
  from common import table
  rows = [[name, f"{med([x['first_step_s'] for x in rs]):.2f}",
           f"{1e3 * med([x['step_s'] for x in rs]):.2f}",
           "1.00" if name == "1x8" else f"**{med(ratios):.2f}** ({min(ratios):.2f}-"
           f"{max(ratios):.2f})"] for name, rs in runs.items()]
  body = table(["processes x CPU devices", "launch to first step s", "step ms",
                "step-time ratio vs 1x8 (min-max)"], rows)
  body += (f"\n\nMLP {args.depth}x{args.width}, global batch {args.rows}, adamw, 8 replicas; "
           f"{args.rounds} rounds of one launch each, alternating; step time: median of "
           f"{args.steps} steps after the first. 2x4 runs gloo collectives over 127.0.0.1.")
  print(body)
  if args.record:
    from common import record
    record("Multi-process launch (bench/launch.py)", body)


if __name__ == "__main__":
  if len(sys.argv) > 1 and sys.argv[1] == "--worker":
    out, started, width, depth, rows, steps = sys.argv[2:8]
    worker(out, float(started), int(width), int(depth), int(rows), int(steps))
  else:
    main()
