"""Starts the workers, relays their output, and ends the job as a whole.

- Output: every line a worker prints (stdout and stderr together) goes to the console as
  ``[worker i] line`` (without the libraries' routine messages unless ``--debug``:
  ``logs.quiet``) and, with ``--log_dir``, unchanged into ``worker_<i>.log``; an earlier run's
  log there moves to ``worker_<i>.log.1`` (``logs.rotate``).
- Faults: the first worker that exits non-zero or dies from a signal ends the job: the others
  get SIGTERM, then SIGKILL after ``FAILURE_GRACE`` seconds, and the launcher exits with that
  worker's status, naming it, its host, how it ended and its log (or its last lines). "First"
  is the order in which the processes ended (each has a thread blocked in ``waitpid``), so a
  worker that failed because its peer died is not the one blamed.
- Hangs: a worker that shows no progress for ``hang_timeout`` seconds ends the job the same
  way. Progress is a step (``Trainer.train_step`` writes its step count to the file named by
  ``EPL_HEARTBEAT_FILE``, see ``runtime.heartbeat``) or a line of output.
- Preemption: SIGTERM (or Ctrl-C's SIGINT) to the launcher is forwarded to every worker, which
  then has ``grace_period`` seconds to save and exit by itself before SIGKILL; the launcher
  exits with 128 + the signal's number. A second signal kills the workers at once.

Each worker runs in its own session (process group): signals reach a shell script's children
too, and on Linux a worker is sent SIGKILL if the launcher itself is killed.
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from epljax.launch import logs
from epljax.launch.jobs import DEFAULT_GRACE_PERIOD, DEFAULT_HANG_TIMEOUT, Worker
from epljax.launch.worker import HEARTBEAT

POLL_S = 0.1
TAIL_LINES = 20
FAILURE_GRACE = 5.0           # the others, after one worker failed: SIGTERM, then SIGKILL


class _Running:
  """One started worker: its process, the moment it ended, its output relay and last lines."""

  def __init__(self, worker: Worker, environ: Mapping[str, str], console: IO[str],
               lock: threading.Lock, foreground: bool, heartbeat: str | None,
               noise: bool = False):
    self.worker = worker
    self.noise = noise        # --debug: the console shows the libraries' messages too
    self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    self.heartbeat = heartbeat
    self.last_output = time.monotonic()
    self.ended_at: float | None = None
    self.done = threading.Event()
    env = {**environ, **worker.env}
    if heartbeat:
      env[HEARTBEAT] = heartbeat
    log = None
    if worker.log_path:
      os.makedirs(os.path.dirname(worker.log_path) or ".", exist_ok=True)
      logs.rotate(worker.log_path)
      log = open(worker.log_path, "w", buffering=1)  # noqa: SIM115 (closed by the relay)
    self.foreground = foreground
    if foreground:   # --debug: this worker keeps the terminal (pdb), in the launcher's group
      self.proc = subprocess.Popen(worker.argv, env=env, preexec_fn=_die_with_parent)
      self.relay = None
      if log:
        log.write("(--debug: this worker's output went to the console)\n")
        log.close()
    else:
      self.proc = subprocess.Popen(
          worker.argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
      self.relay = threading.Thread(target=self._relay, args=(console, lock, log), daemon=True)
      self.relay.start()
    threading.Thread(target=self._wait, daemon=True).start()

  def _wait(self) -> None:
    self.proc.wait()
    self.ended_at = time.monotonic()
    self.done.set()

  def _relay(self, console: IO[str], lock: threading.Lock, log: IO[str] | None) -> None:
    prefix = f"[worker {self.worker.index}] "
    try:
      for raw in iter(self.proc.stdout.readline, b""):
        self.last_output = time.monotonic()
        # A progress bar redraws its line with carriage returns: keep what a terminal would
        # show at the end of it, so each line of the log is one prefixed line.
        line = raw.decode("utf-8", "replace").rstrip("\n").rstrip("\r").split("\r")[-1]
        if log:
          log.write(line + "\n")
        line = line if self.noise else logs.quiet(line)
        if line is None:
          continue
        self.tail.append(line)
        with lock:
          console.write(prefix + line + "\n")
          console.flush()
    finally:
      if log:
        log.close()

  @property
  def code(self) -> int | None:
    """The exit status once ended (negative: killed by that signal), else None."""
    return self.proc.returncode if self.done.is_set() else None

  def progress(self) -> tuple[float, int | None]:
    """(monotonic time of the last step or output line, steps reported so far)."""
    last, steps = self.last_output, None
    if self.heartbeat:
      try:
        st = os.stat(self.heartbeat)
        with open(self.heartbeat, "rb") as f:
          steps = int(f.read(32).split()[0])
      except (OSError, ValueError, IndexError):
        pass
      else:
        last = max(last, time.monotonic() - max(0.0, time.time() - st.st_mtime))
    return last, steps

  def signal(self, signum: int) -> None:
    try:
      if self.foreground:
        self.proc.send_signal(signum)
      else:
        os.killpg(self.proc.pid, signum)
    except (ProcessLookupError, PermissionError):
      pass


def run(workers: Sequence[Worker], environ: Mapping[str, str], *, debug: bool = False,
        grace_period: float = DEFAULT_GRACE_PERIOD, hang_timeout: float = DEFAULT_HANG_TIMEOUT,
        console: IO[str] | None = None) -> int:
  """Runs the workers to the end; returns 0, or the status of the job's end (module doc)."""
  console = console or sys.stdout
  lock = threading.Lock()
  signals: list[int] = []

  def on_signal(signum, _frame):
    signals.append(signum)

  previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
  running: list[_Running] = []
  with tempfile.TemporaryDirectory(prefix="epljax-launch-") as beats:
    try:
      for i, w in enumerate(workers):
        beat = os.path.join(beats, f"worker_{w.index}.step") if hang_timeout else None
        running.append(_Running(w, environ, console, lock, debug and i == 0, beat, debug))
      return _watch(running, signals, grace_period, hang_timeout, console, lock)
    finally:
      _stop(running, signal.SIGTERM, FAILURE_GRACE)
      for s, handler in previous.items():
        signal.signal(s, handler)


def _watch(running: list[_Running], signals: list[int], grace_period: float,
           hang_timeout: float, console: IO[str], lock: threading.Lock) -> int:
  while True:
    if signals:
      return _forward(running, signals, grace_period, console, lock)
    ended = sorted((r for r in running if r.code is not None), key=lambda r: r.ended_at)
    failed = next((r for r in ended if r.code != 0), None)
    if failed is not None:
      others = [r for r in running if r.code is None]
      _stop(others, signal.SIGTERM, FAILURE_GRACE)
      _finish_relays(running)
      _say(console, lock, _failure(failed, how_ended(failed.code), others, running))
      return _status(failed.code)
    if len(ended) == len(running):
      _finish_relays(running)
      return 0
    hung = _hung(running, hang_timeout)
    if hung:
      others = [r for r in running if r.code is None and r is not hung[0][0]]
      _stop([hung[0][0]], signal.SIGKILL, 0)   # its stack is in its log if it printed one
      _stop(others, signal.SIGTERM, FAILURE_GRACE)
      _finish_relays(running)
      _say(console, lock, _failure(hung[0][0], _hang_text(hung, hang_timeout), others, running))
      return 124
    time.sleep(POLL_S)


def _forward(running: list[_Running], signals: list[int], grace_period: float,
             console: IO[str], lock: threading.Lock) -> int:
  """The launcher got ``signals[0]``: every worker gets it, and ``grace_period`` to exit."""
  signum = signals[0]
  name = signal.Signals(signum).name
  alive = [r for r in running if r.code is None]
  _say(console, lock, f"received {name}: forwarded to the {len(alive)} running worker(s); "
       f"waiting up to {_seconds(grace_period)} s (--grace_period) for them to exit "
       f"(another {name} kills them now)")
  killed = _stop(alive, signum, grace_period, interrupt=lambda: len(signals) > 1)
  _finish_relays(running)
  ends = ", ".join(f"worker {r.worker.index} {how_ended(r.code)}" for r in alive)
  if killed:
    _say(console, lock, f"killed worker(s) {[r.worker.index for r in killed]} (SIGKILL): "
         f"still running after the grace period; the others: {ends or 'none'}")
  else:
    _say(console, lock, f"every worker ended after {name}: {ends or 'none was running'}")
  return 128 + signum


def _hung(running: Sequence[_Running], hang_timeout: float) -> list[tuple[_Running, float, int]]:
  """The running workers without progress for ``hang_timeout`` s, the one furthest behind
  first (the fewest steps, then the oldest progress): the others usually wait for it."""
  if not hang_timeout:
    return []
  now = time.monotonic()
  stale = []
  for r in running:
    if r.code is None:
      last, steps = r.progress()
      if now - last >= hang_timeout:
        stale.append((r, now - last, steps))
  return sorted(stale, key=lambda s: (-1 if s[2] is None else s[2], -s[1]))


def _hang_text(hung: list[tuple[_Running, float, int | None]], hang_timeout: float) -> str:
  r, idle, steps = hung[0]
  at = "before its first step" if not steps else f"after step {steps}"
  text = (f"made no progress (no step, no output) for {idle:.0f} s {at}, over --hang_timeout "
          f"{_seconds(hang_timeout)}; killed it")
  if len(hung) > 1:
    text += (f" (also idle: worker(s) {[h[0].worker.index for h in hung[1:]]}, "
             "probably waiting for it in a collective)")
  return text


def _stop(running: Sequence[_Running], signum: int, grace: float,
          interrupt=lambda: False) -> list[_Running]:
  """``signum`` to every live worker, SIGKILL to those still alive after ``grace`` seconds
  (or when ``interrupt()``); returns the workers that needed SIGKILL."""
  alive = [r for r in running if r.code is None]
  for r in alive:
    r.signal(signum)
  deadline = time.monotonic() + grace
  while (any(r.code is None for r in alive) and time.monotonic() < deadline
         and not interrupt()):
    time.sleep(POLL_S)
  killed = [r for r in alive if r.code is None]
  for r in killed:
    r.signal(signal.SIGKILL)
  for r in killed:
    r.done.wait(timeout=10.0)
  # A worker's own children (a shell script's python) may outlive it: clear its group too.
  for r in running:
    if not r.foreground:
      r.signal(signal.SIGKILL)
  return killed


def _finish_relays(running: Sequence[_Running]) -> None:
  for r in running:
    if r.relay is not None:
      r.relay.join(timeout=2.0)


def how_ended(code: int | None) -> str:
  if code is None:
    return "still running"
  if code >= 0:
    return f"exited with code {code}"
  return (f"was killed by {signal.Signals(-code).name}" if -code in _SIGNALS else
          f"ended with status {code}")


def _status(code: int) -> int:
  return code if code > 0 else 128 - code


def _failure(failed: _Running, how: str, stopped: Sequence[_Running],
             running: Sequence[_Running]) -> str:
  """What ended the job: the failed worker, what became of each other worker (stopped by us,
  or already ended on its own, e.g. a collective that lost its peer), and where its log is."""
  w = failed.worker
  where = (f"Its log: {w.log_path}" if w.log_path else
           f"Its last lines (prefixed [worker {w.index}] above; --log_dir DIR keeps a log "
           "per worker):\n    " + "\n    ".join(failed.tail))
  others = []
  if stopped:
    others.append(f"stopped the {len(stopped)} other running worker(s)")
  ended = [r for r in running if r is not failed and not any(r is s for s in stopped)]
  if ended:
    others.append("already ended: " + ", ".join(
        f"worker {r.worker.index} {how_ended(r.code)}" for r in ended))
  return f"worker {w.index} (on {_HOST}) {how}; {'; '.join(others) or 'no other worker'}. {where}"


_SIGNALS = {s.value for s in signal.Signals}
_HOST = socket.gethostname()


def _seconds(value: float) -> str:
  return str(int(value)) if float(value).is_integer() else str(value)


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
