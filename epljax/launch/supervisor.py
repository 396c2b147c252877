"""Starts the workers, relays their output, and stops them all when one fails.

- Output: every line a worker prints (stdout and stderr together) goes to the console as
  ``[worker i] line`` and, with ``--log_dir``, unchanged into ``worker_<i>.log``.
- Faults: the first worker that exits non-zero or dies from a signal ends the job: the others
  get SIGTERM, then SIGKILL after ``grace`` seconds, and the launcher exits non-zero naming the
  worker, how it ended and its log (or its last lines when there is no log).
- Ctrl-C (SIGINT) or SIGTERM to the launcher stops every worker the same way.

Each worker runs in its own session (process group), so a shell script's children are stopped
with it, and on Linux a worker is sent SIGKILL if the launcher itself is killed.
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from epljax.launch.jobs import Worker

POLL_S = 0.1
TAIL_LINES = 20


class _Running:
  """One started worker: its process, output relay and last lines."""

  def __init__(self, worker: Worker, environ: Mapping[str, str], console: IO[str],
               lock: threading.Lock, foreground: bool):
    self.worker = worker
    self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    env = {**environ, **worker.env}
    log = None
    if worker.log_path:
      os.makedirs(os.path.dirname(worker.log_path) or ".", exist_ok=True)
      log = open(worker.log_path, "w", buffering=1)  # noqa: SIM115 (closed by the relay)
    self.foreground = foreground
    if foreground:   # --debug: this worker keeps the terminal (pdb), in the launcher's group
      self.proc = subprocess.Popen(worker.argv, env=env, preexec_fn=_die_with_parent)
      self.relay = None
      if log:
        log.write("(--debug: this worker's output went to the console)\n")
        log.close()
      return
    self.proc = subprocess.Popen(
        worker.argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
    self.relay = threading.Thread(target=self._relay, args=(console, lock, log), daemon=True)
    self.relay.start()

  def _relay(self, console: IO[str], lock: threading.Lock, log: IO[str] | None) -> None:
    prefix = f"[worker {self.worker.index}] "
    try:
      for raw in iter(self.proc.stdout.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        self.tail.append(line)
        if log:
          log.write(line + "\n")
        with lock:
          console.write(prefix + line + "\n")
          console.flush()
    finally:
      if log:
        log.close()

  def signal(self, signum: int) -> None:
    try:
      if self.foreground:
        self.proc.send_signal(signum)
      else:
        os.killpg(self.proc.pid, signum)
    except (ProcessLookupError, PermissionError):
      pass


def run(workers: Sequence[Worker], environ: Mapping[str, str], *, debug: bool = False,
        grace: float = 5.0, console: IO[str] | None = None) -> int:
  """Runs the workers to the end; returns 0, or the failing worker's exit status."""
  console = console or sys.stdout
  lock = threading.Lock()
  stop_requested: list[int] = []

  def on_signal(signum, _frame):
    stop_requested.append(signum)

  previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
  running: list[_Running] = []
  try:
    for i, w in enumerate(workers):
      running.append(_Running(w, environ, console, lock, foreground=debug and i == 0))
    return _watch(running, stop_requested, grace, console, lock)
  finally:
    _stop(running, signal.SIGTERM, grace)
    for s, handler in previous.items():
      signal.signal(s, handler)


def _watch(running: list[_Running], stop_requested: list[int], grace: float, console: IO[str],
           lock: threading.Lock) -> int:
  while True:
    if stop_requested:
      signum = stop_requested[0]
      _say(console, lock, f"received {signal.Signals(signum).name}: stopping all "
           f"{len(running)} worker(s)")
      _stop(running, signum, grace)
      return 128 + signum
    codes = [r.proc.poll() for r in running]
    failed = next((r for r, c in zip(running, codes) if c not in (None, 0)), None)
    if failed is not None:
      others = [r for r in running if r is not failed and r.proc.poll() is None]
      _stop(others, signal.SIGTERM, grace)
      _finish_relays(running)
      _say(console, lock, _failure(failed, len(others)))
      code = failed.proc.returncode
      return code if code > 0 else 128 - code
    if all(c == 0 for c in codes):
      _finish_relays(running)
      return 0
    time.sleep(POLL_S)


def _stop(running: Sequence[_Running], signum: int, grace: float) -> None:
  """``signum`` to every live worker, SIGKILL to those still alive after ``grace`` seconds."""
  alive = [r for r in running if r.proc.poll() is None]
  for r in alive:
    r.signal(signum)
  deadline = time.monotonic() + grace
  while any(r.proc.poll() is None for r in alive) and time.monotonic() < deadline:
    time.sleep(POLL_S)
  for r in alive:
    if r.proc.poll() is None:
      r.signal(signal.SIGKILL)
  for r in alive:
    try:
      r.proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
      pass
  # A worker's own children (a shell script's python) may outlive it: clear its group too.
  for r in running:
    if not r.foreground:
      r.signal(signal.SIGKILL)


def _finish_relays(running: Sequence[_Running]) -> None:
  for r in running:
    if r.relay is not None:
      r.relay.join(timeout=2.0)


def _failure(failed: _Running, stopped: int) -> str:
  code = failed.proc.returncode
  how = (f"exited with code {code}" if code > 0 else
         f"was killed by {signal.Signals(-code).name}" if -code in _SIGNALS else
         f"ended with status {code}")
  w = failed.worker
  where = (f"Its log: {w.log_path}" if w.log_path else
           f"Its last lines (prefixed [worker {w.index}] above; --log_dir DIR keeps a log "
           "per worker):\n    " + "\n    ".join(failed.tail))
  return (f"worker {w.index} {how}; stopped the {stopped} other running worker(s). {where}")


_SIGNALS = {s.value for s in signal.Signals}


def _say(console: IO[str], lock: threading.Lock, text: str) -> None:
  with lock:
    console.write(f"epljax.launch: {text}\n")
    console.flush()


def _load_prctl():
  if not sys.platform.startswith("linux"):
    return None
  try:
    return ctypes.CDLL(None, use_errno=True).prctl
  except (OSError, AttributeError):
    return None


_PRCTL = _load_prctl()   # looked up here, not in the forked child
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
  """In the child before exec: SIGKILL when the launcher dies (Linux ``PR_SET_PDEATHSIG``)."""
  if _PRCTL is not None:
    _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
