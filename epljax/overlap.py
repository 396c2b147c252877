"""What a compiled step's schedule hides of its communication.

XLA:GPU's latency-hiding scheduler splits a collective into ``*-start`` and ``*-done`` (or
``async-start``/``async-done`` around it) and places compute between them: the collective runs
on its own stream while that compute runs. ``hidden_seconds`` replays the schedule as written
on two clocks, one for compute and one for the collective stream:

- an instruction that computes advances the compute clock by its matmul FLOPs / ``rate``;
- ``*-start`` queues its collective on the collective stream (collectives run one at a time, in
  the order started), from the compute clock's time;
- ``*-done`` waits: the compute clock moves to when its collective finishes;
- a synchronous collective waits for the stream and then for itself;
- a ``while`` replays its body once per trip (``known_trip_count``), carrying what is still in
  flight into the next trip: a ``*-done`` whose start is not in sight (a collective XLA
  pipelined across iterations) waits for the oldest collective still in flight;
- a ``conditional`` costs its slowest branch, a ``call`` or ``fusion`` what it calls.

The step's exposed communication is the replay's total less its compute; what the collectives
cost beyond that is hidden. Communication the schedule does not overlap (XLA:CPU runs its
collectives synchronously) is all exposed, as before. Unit-tested on HLO text
(``tests/test_auto_plan.py``) and on an XLA:GPU compile (``tests/test_aot.py``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from epljax import hlo

_START = re.compile(r"^(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|"
                    r"collective-permute)-start$")
_DONE = re.compile(r"^(?:all-reduce|all-gather|reduce-scatter|all-to-all|"
                   r"collective-permute|async)-done$")
_OPERAND = re.compile(r"%?([\w.\-]+)")
_CALLS = re.compile(r"\bcalls=%?(?P<name>[\w.\-]+)")
_BODY = re.compile(r"\bbody=%?(?P<name>[\w.\-]+)")
_NO_COMPUTE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-start",
               "copy-done", "after-all", "partition-id", "replica-id"}


@dataclasses.dataclass(frozen=True)
class Overlap:
  """The replay of a step's schedule: seconds of compute, of collectives, and in all."""
  compute_s: float
  communication_s: float
  total_s: float

  @property
  def exposed_s(self) -> float:
    return max(0.0, self.total_s - self.compute_s)

  @property
  def hidden_s(self) -> float:
    return max(0.0, self.communication_s - self.exposed_s)


@dataclasses.dataclass
class _Clock:
  now: float = 0.0                 # compute stream
  stream: float = 0.0              # collective stream: when it is free
  compute: float = 0.0
  comm: float = 0.0
  flight: dict[str, float] = dataclasses.field(default_factory=dict)  # start name -> finish


def replay(hlo_text: str, seconds: Callable[[hlo.Collective], float],
           flops_of: Callable[[str, dict[str, str]], float], rate: float) -> Overlap:
  """The schedule of ``hlo_text`` replayed (module doc). ``seconds``: a collective's time on
  its links; ``flops_of(line, types)``: the matmul FLOPs of one instruction line (``types``:
  instruction name -> its type in that computation); ``rate``: FLOP/s."""
  bodies, entry, _ = hlo._computations(hlo_text)
  if entry is None:
    return Overlap(0.0, 0.0, 0.0)
  flops_memo: dict[str, float] = {}

  def called_flops(name: str) -> float:
    """FLOPs of a computation run inline (a fusion's), with what it calls."""
    if name not in flops_memo:
      flops_memo[name] = 0.0
      lines = bodies.get(name, [])
      types = _types(lines)
      flops_memo[name] = sum(flops_of(line, types) + sum(
          called_flops(m["name"]) for m in _CALLS.finditer(line)) for line in lines)
    return flops_memo[name]

  def run(name: str, clock: _Clock) -> None:
    lines = bodies.get(name, [])
    types = _types(lines)
    for line in lines:
      m = hlo._INSTRUCTION.match(line)
      if not m:
        continue
      op, inst = m["op"], m["name"]
      start = _START.match(op)
      if start or op == "async-start":
        found = hlo.collectives(line) if start else _async_collectives(line, bodies)
        t = sum(seconds(c) for c in found)
        if not found:   # (an async op that is no collective: compute)
          _compute(clock, _flops(line, types, called_flops, flops_of) / rate)
          continue
        clock.stream = max(clock.stream, clock.now) + t
        clock.comm += t
        clock.flight[inst] = clock.stream
      elif _DONE.match(op):
        operand = _OPERAND.match(m["operands"].strip())
        key = operand.group(1) if operand else ""
        if key in clock.flight:
          clock.now = max(clock.now, clock.flight.pop(key))
        elif clock.flight:   # started in an earlier trip of a loop: the oldest in flight
          oldest = min(clock.flight, key=clock.flight.get)
          clock.now = max(clock.now, clock.flight.pop(oldest))
      elif op in hlo.KINDS:
        t = sum(seconds(c) for c in hlo.collectives(line))
        clock.stream = max(clock.stream, clock.now) + t
        clock.comm += t
        clock.now = clock.stream
      elif op == "while":
        body = _BODY.search(line)
        trips = hlo._TRIPS.search(line)
        for _ in range(int(trips["n"]) if trips else 1):
          if body:
            run(body["name"], clock)
      elif op == "conditional":
        branches = hlo._BRANCHES.search(line)
        names = (re.findall(r"%?([\w.\-]+)", branches["names"]) if branches else
                 [c["name"] for c in hlo._CALLEE.finditer(line)
                  if c["kind"] in ("true_computation", "false_computation")])
        best = None
        for branch in names:
          trial = dataclasses.replace(clock, flight=dict(clock.flight))
          run(branch, trial)
          if best is None or trial.now > best.now:
            best = trial
        if best is not None:
          clock.now, clock.stream, clock.compute, clock.comm, clock.flight = (
              best.now, best.stream, best.compute, best.comm, best.flight)
      elif op == "call":
        for c in hlo._CALLEE.finditer(line):
          if c["kind"] == "to_apply":
            run(c["name"], clock)
      elif op not in _NO_COMPUTE:
        _compute(clock, _flops(line, types, called_flops, flops_of) / rate)

  clock = _Clock()
  run(entry, clock)
  end = max([clock.now, *clock.flight.values()])
  return Overlap(clock.compute, clock.comm, end)


def _compute(clock: _Clock, seconds: float) -> None:
  clock.now += seconds
  clock.compute += seconds


def _flops(line: str, types: dict[str, str], called_flops, flops_of) -> float:
  return flops_of(line, types) + sum(called_flops(m["name"]) for m in _CALLS.finditer(line))


def _async_collectives(line: str, bodies: dict[str, list[str]]) -> list[hlo.Collective]:
  """The collectives an ``async-start`` wraps (its ``calls=`` computation)."""
  m = _CALLS.search(line)
  return hlo.collectives("\n".join(bodies.get(m["name"], []))) if m else []


def _types(lines: list[str]) -> dict[str, str]:
  return {m["name"]: m["type"] for m in hlo._INSTRUCTION.finditer("\n".join(lines))}
