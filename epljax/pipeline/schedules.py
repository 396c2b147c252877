"""Pipeline schedules as tick tables: which micro batch each stage runs forward and backward.

The runtime (``runtime.py``) runs every stage in lockstep, one *tick* at a time. In a tick each
stage has one forward slot and one backward slot (either may be idle), then activations move
one stage down and gradients one stage up (``ppermute``). A schedule is therefore four
``(ticks, stages)`` integer tables: the micro batch of each slot (``-1``: idle) and the stash
slot that keeps what the backward needs between a micro batch's forward and its backward.

- ``PreferForward`` (GPipe): forward ``m`` on stage ``s`` at tick ``m + s``; the backwards
  start after the last forward, last micro batch first: ``2M + 2S - 3`` ticks, each with a
  forward and a backward slot; stage ``s`` keeps all ``M`` micro batches. With forward time
  ``f`` and backward time ``b`` a step takes ``(M + S - 1)(f + b)``.
- ``PreferBackward`` (1F1B, EPL's default): the textbook one-forward-one-backward. Forward
  ``m`` on stage ``s`` at tick ``s + 2m``, its backward at tick ``2S - 1 - s + 2m`` (the tick
  after its forward left the last stage, one stage up per tick). The two have different
  parities on a stage, so a stage runs a forward *or* a backward in a tick: ``2M + 2S - 2``
  ticks of ``max(f, b)``, and stage ``s`` keeps at most ``S - s`` micro batches (a micro batch
  enters every other tick and its round trip takes ``2(S - 1 - s) + 1`` ticks), however large
  ``M`` is. (Running a forward and a backward in every tick, as GPipe does, would make the
  round trip twice as long in ticks and keep ``2(S - s) - 1``.)

Idle slots skip their compute (a ``lax.switch`` to an empty branch), so a tick costs what its
busiest stage does. Either way the bubble fraction is ``(S - 1) / (M + S - 1)``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

PREFER_BACKWARD, PREFER_FORWARD = "PreferBackward", "PreferForward"
NAMES = {PREFER_BACKWARD: "1F1B", PREFER_FORWARD: "GPipe"}
IDLE = -1


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
  """The tick tables of one schedule; every table is ``(num_ticks, num_stages)`` int32."""
  strategy: str
  num_stages: int
  num_micro_batch: int
  forward: np.ndarray        # micro batch run forward, or IDLE
  backward: np.ndarray       # micro batch run backward, or IDLE
  forward_slot: np.ndarray   # stash slot the forward writes (0 when idle)
  backward_slot: np.ndarray  # stash slot the backward reads (0 when idle)
  num_slots: int             # stash slots per stage: the most micro batches kept at once

  @property
  def num_ticks(self) -> int:
    return self.forward.shape[0]

  @property
  def bubble_fraction(self) -> float:
    s, m = self.num_stages, self.num_micro_batch
    return (s - 1) / (m + s - 1)

  @property
  def kept_per_stage(self) -> list[int]:
    """The most micro batches each stage keeps for their backward at any one time."""
    return [int(_peak_live(self.forward[:, s], self.backward[:, s]))
            for s in range(self.num_stages)]

  def describe(self) -> str:
    return (f"{self.strategy} ({NAMES[self.strategy]}): {self.num_ticks} ticks, bubble "
            f"(S-1)/(M+S-1) = {self.num_stages - 1}/{self.num_micro_batch + self.num_stages - 1}"
            f" = {self.bubble_fraction:.0%}, keeps at most {self.num_slots} micro batches per "
            "stage")


def make_schedule(strategy: str, num_stages: int, num_micro_batch: int) -> Schedule:
  """The tick tables of ``strategy`` (``"PreferBackward"`` or ``"PreferForward"``)."""
  if strategy not in NAMES:
    raise ValueError(f"pipeline.strategy must be one of {sorted(NAMES)}, got {strategy!r}.")
  s_count, m_count = num_stages, num_micro_batch
  if strategy == PREFER_BACKWARD:
    ticks = 2 * m_count + 2 * s_count - 2

    def forward_tick(m, s):
      return s + 2 * m

    def backward_tick(m, s):   # the tick after its forward on the last stage, one stage a tick
      return 2 * s_count - 1 - s + 2 * m
  else:
    ticks = 2 * m_count + 2 * s_count - 3

    def forward_tick(m, s):
      return m + s

    def backward_tick(m, s):   # after the last forward, last micro batch first
      return (m_count + s_count - 2) + (m_count - 1 - m) + (s_count - 1 - s)
  forward = np.full((ticks, s_count), IDLE, np.int32)
  backward = np.full((ticks, s_count), IDLE, np.int32)
  for m in range(m_count):
    for s in range(s_count):
      forward[forward_tick(m, s), s] = m
      backward[backward_tick(m, s), s] = m
  forward_slot, backward_slot, slots = _assign_slots(forward, backward)
  schedule = Schedule(strategy, s_count, m_count, forward, backward, forward_slot, backward_slot,
                      slots)
  check_schedule(schedule)
  return schedule


def _assign_slots(forward: np.ndarray, backward: np.ndarray):
  """Stash slots, per stage: a forward takes the lowest free slot, its backward frees it.

  Within a tick the forward runs before the backward, so the last stage may write and read
  the same slot in one tick.
  """
  ticks, stages = forward.shape
  f_slot = np.zeros_like(forward)
  b_slot = np.zeros_like(backward)
  most = 1
  for s in range(stages):
    free, held = [], {}
    for t in range(ticks):
      m = forward[t, s]
      if m != IDLE:
        slot = min(free) if free else len(held)
        if free:
          free.remove(slot)
        held[m] = slot
        f_slot[t, s] = slot
        most = max(most, slot + 1)
      m = backward[t, s]
      if m != IDLE:
        slot = held.pop(m)
        b_slot[t, s] = slot
        free.append(slot)
  return f_slot, b_slot, most


def _peak_live(forward_col: np.ndarray, backward_col: np.ndarray) -> int:
  live = peak = 0
  for f, b in zip(forward_col, backward_col):
    live += f != IDLE
    peak = max(peak, live)
    live -= b != IDLE
  return peak


def check_schedule(schedule: Schedule) -> None:
  """Raises ``AssertionError`` unless every dependency of the pipeline holds.

  Forward ``m`` on stage ``s`` needs forward ``m`` of stage ``s - 1`` in the tick before (the
  activation arrives by one ``ppermute``); backward ``m`` on stage ``s`` needs backward ``m``
  of stage ``s + 1`` in the tick before, or, on the last stage, its own forward in the same
  tick or earlier; every micro batch runs once forward and once backward on every stage; two
  micro batches kept on a stage never share a slot. (Internal invariant, not user input.)
  """
  f, b = schedule.forward, schedule.backward
  ticks, stages = f.shape
  m_count = schedule.num_micro_batch
  where_f = {(int(f[t, s]), s): t for t in range(ticks) for s in range(stages) if f[t, s] >= 0}
  where_b = {(int(b[t, s]), s): t for t in range(ticks) for s in range(stages) if b[t, s] >= 0}
  want = {(m, s) for m in range(m_count) for s in range(stages)}
  assert set(where_f) == want and set(where_b) == want, "each micro batch once per stage"
  assert (f >= 0).sum() == len(want) and (b >= 0).sum() == len(want), "no repeats"
  for (m, s), t in where_f.items():
    assert s == 0 or where_f[(m, s - 1)] == t - 1, f"forward {m} on stage {s} at tick {t}"
  for (m, s), t in where_b.items():
    if s == stages - 1:
      assert where_f[(m, s)] <= t, f"backward {m} before its forward on the last stage"
    else:
      assert where_b[(m, s + 1)] == t - 1, f"backward {m} on stage {s} at tick {t}"
  for s in range(stages):
    live: dict[int, int] = {}
    for t in range(ticks):
      if f[t, s] >= 0:
        slot = int(schedule.forward_slot[t, s])
        assert slot not in live.values() and slot < schedule.num_slots, "slot clash"
        live[int(f[t, s])] = slot
      if b[t, s] >= 0:
        assert live.pop(int(b[t, s])) == schedule.backward_slot[t, s], "slot mismatch"
