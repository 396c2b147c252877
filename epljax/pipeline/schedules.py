"""Pipeline schedules as tick tables: which micro batch each stage runs forward and backward.

The runtime (``runtime.py``) runs every stage in lockstep, one *tick* at a time. In a tick each
stage has one forward slot and one backward slot (either may be idle), then activations move
one stage down and gradients one stage up (``ppermute``). A schedule is therefore six
``(ticks, stages)`` integer tables: the micro batch of each slot (``-1``: idle), the model
chunk it runs (``num_virtual_stages > 1``), and the stash slot that keeps what the backward
needs between a micro batch's forward and its backward.

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

**Interleaved** (``num_virtual_stages = v > 1``, Megatron's circular layout): the model is
``C = vS`` chunks and stage ``s`` holds chunks ``s, s + S, ..., s + (v - 1)S``, so a micro
batch goes round the ring of stages ``v`` times (stage ``S - 1`` hands chunk ``jS + S - 1``'s
output to stage 0 for chunk ``(j + 1)S``). A tick now costs ``(f + b) / v``. Micro batches go in
groups of ``S``: micro batch ``m = gS + r`` starts at tick ``gvS + r`` and runs chunk ``c`` at
tick ``gvS + r + c``; in a group's ``vS`` ticks each stage runs ``S`` micro batches on each of
its ``v`` chunks without a gap, so the forwards fill ``vM + S - 1`` ticks, of which a stage idles
``S - 1``. With 1F1B the backward of chunk ``c`` runs at tick ``gvS + r + 2C - 2 - c`` (the last
chunk's backward in the tick of its forward), so every stage runs one forward and one backward
per tick in the steady state and keeps ``vS + S - 1 - 2s`` chunks at most, whatever ``M``
(Megatron's warm-up plus one: ``S + (S - 1 - 2s)/v`` stages' worth); with GPipe the backwards
follow all forwards as above and a stage keeps all ``vM`` chunks. The bubble is
``(S - 1) / (vM + S - 1)`` (about ``v`` times smaller), for ``v`` times as many ``ppermute``
hops per micro batch; ``M`` must be a multiple of ``S``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from epljax.errors import PlanError

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
  num_virtual_stages: int
  forward_chunk: np.ndarray    # which of the stage's chunks (0..v-1)
  backward_chunk: np.ndarray

  @property
  def num_ticks(self) -> int:
    return self.forward.shape[0]

  @property
  def num_chunks(self) -> int:
    """Model chunks: stages x virtual stages."""
    return self.num_stages * self.num_virtual_stages

  @property
  def name(self) -> str:
    base = NAMES[self.strategy]
    return base if self.num_virtual_stages == 1 else f"interleaved {base}"

  @property
  def bubble_fraction(self) -> float:
    """``(S - 1) / (vM + S - 1)``: what ``measured_bubble`` finds in the tables."""
    s, m, v = self.num_stages, self.num_micro_batch, self.num_virtual_stages
    return (s - 1) / (v * m + s - 1)

  def tick_costs(self, forward: float = 1.0, backward: float = 1.0) -> np.ndarray:
    """Per tick, how long the lockstep tick takes when a stage's whole forward takes
    ``forward`` and its backward ``backward`` (a chunk's: ``1/v`` of those): its busiest
    stage's forward and backward slots."""
    v = self.num_virtual_stages
    per_stage = (forward / v) * (self.forward != IDLE) + (backward / v) * (self.backward != IDLE)
    return per_stage.max(axis=1)

  def measured_bubble(self, forward: float = 1.0, backward: float = 1.0) -> float:
    """The fraction of the step a stage idles, from the tables: ``1 - work / time``."""
    time = float(self.tick_costs(forward, backward).sum())
    work = self.num_micro_batch * (forward + backward)
    return 1.0 - work / time

  @property
  def kept_per_stage(self) -> list[int]:
    """The most micro batch chunks each stage keeps for their backward at any one time: the
    stash slots it uses (a forward takes the lowest free one, ``_assign_slots``)."""
    return [int(self.forward_slot[:, s].max(initial=0, where=self.forward[:, s] != IDLE)) + 1
            for s in range(self.num_stages)]

  def describe(self) -> str:
    s, m, v = self.num_stages, self.num_micro_batch, self.num_virtual_stages
    vm, what = ("M", "micro batches") if v == 1 else (f"{v}M", "micro batch chunks")
    layout = "" if v == 1 else f", {v} chunks per stage (S={s}, {s * v} chunks)"
    return (f"{self.strategy} ({self.name}){layout}: {self.num_ticks} ticks, bubble "
            f"(S-1)/({vm}+S-1) = {s - 1}/{v * m + s - 1} = {self.bubble_fraction:.0%}, keeps "
            f"at most {self.num_slots} {what} per stage")


def make_schedule(strategy: str, num_stages: int, num_micro_batch: int,
                  num_virtual_stages: int = 1) -> Schedule:
  """The tick tables of ``strategy`` (``"PreferBackward"`` or ``"PreferForward"``), interleaved
  over ``num_virtual_stages`` chunks per stage when that is more than 1."""
  if strategy not in NAMES:
    raise ValueError(f"pipeline.strategy must be one of {sorted(NAMES)}, got {strategy!r}.")
  s_count, m_count, v = num_stages, num_micro_batch, num_virtual_stages
  if v > 1 and m_count % s_count:
    raise PlanError(_GROUPS.format(m=m_count, s=s_count, v=v, lo=max(s_count, m_count - m_count
                                   % s_count), hi=m_count + s_count - m_count % s_count))
  chunks = s_count * v
  if v > 1:
    def start(m):   # groups of S micro batches, one group every vS ticks
      g, r = divmod(m, s_count)
      return g * chunks + r

    def forward_tick(m, c):
      return start(m) + c
  elif strategy == PREFER_BACKWARD:
    def forward_tick(m, c):
      return c + 2 * m
  else:
    def forward_tick(m, c):
      return m + c
  last_forward = forward_tick(m_count - 1, chunks - 1)
  if strategy == PREFER_BACKWARD and v > 1:
    def backward_tick(m, c):   # the last chunk's in the tick of its forward, one chunk a tick
      return start(m) + 2 * chunks - 2 - c
  elif strategy == PREFER_BACKWARD:
    def backward_tick(m, c):   # the tick after its forward on the last stage, one stage a tick
      return 2 * s_count - 1 - c + 2 * m
  else:
    def backward_tick(m, c):   # after the last forward, last micro batch first
      return last_forward + forward_tick(m_count - 1 - m, chunks - 1 - c) - forward_tick(0, 0)
  ticks = max(backward_tick(m, c) for m in range(m_count) for c in range(chunks)) + 1
  tables = [np.full((ticks, s_count), IDLE, np.int32) for _ in range(2)]
  chunk_tables = [np.zeros((ticks, s_count), np.int32) for _ in range(2)]
  for m in range(m_count):
    for c in range(chunks):
      for table, chunk, t in zip(tables, chunk_tables, (forward_tick(m, c), backward_tick(m, c))):
        if table[t, c % s_count] != IDLE:   # internal invariant
          raise AssertionError(f"two micro batches in one slot at tick {t}, chunk {c}")
        table[t, c % s_count], chunk[t, c % s_count] = m, c // s_count
  forward, backward = tables
  forward_slot, backward_slot, slots = _assign_slots(forward, backward, *chunk_tables)
  schedule = Schedule(strategy, s_count, m_count, forward, backward, forward_slot, backward_slot,
                      slots, v, *chunk_tables)
  check_schedule(schedule)
  return schedule


def _assign_slots(forward: np.ndarray, backward: np.ndarray, f_chunk: np.ndarray,
                  b_chunk: np.ndarray):
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
        held[m, f_chunk[t, s]] = slot
        f_slot[t, s] = slot
        most = max(most, slot + 1)
      m = backward[t, s]
      if m != IDLE:
        slot = held.pop((m, b_chunk[t, s]))
        b_slot[t, s] = slot
        free.append(slot)
  return f_slot, b_slot, most


def check_schedule(schedule: Schedule) -> None:
  """Raises ``AssertionError`` unless every dependency of the pipeline holds.

  Chunk ``c`` runs on stage ``c % S`` (``c = s`` without virtual stages). Forward ``m`` of
  chunk ``c`` needs forward ``m`` of chunk ``c - 1`` in the tick before (the activation arrives
  by one ``ppermute`` and is gone the tick after); backward ``m`` of chunk ``c`` needs backward
  ``m`` of chunk ``c + 1`` in the tick before, or, for the last chunk, its own forward in the
  same tick or earlier; every micro batch runs once forward and once backward on every chunk;
  two micro batches kept on a stage never share a slot. (Internal invariant, not user input.)
  """
  f, b = schedule.forward, schedule.backward
  ticks, stages = f.shape
  chunks, m_count = schedule.num_chunks, schedule.num_micro_batch

  def where(table, chunk):
    return {(int(table[t, s]), int(chunk[t, s]) * stages + s): t
            for t in range(ticks) for s in range(stages) if table[t, s] >= 0}

  where_f, where_b = where(f, schedule.forward_chunk), where(b, schedule.backward_chunk)
  want = {(m, c) for m in range(m_count) for c in range(chunks)}
  assert set(where_f) == want and set(where_b) == want, "each micro batch once per chunk"
  assert (f >= 0).sum() == len(want) and (b >= 0).sum() == len(want), "no repeats"
  for (m, c), t in where_f.items():
    assert c == 0 or where_f[(m, c - 1)] == t - 1, f"forward {m} of chunk {c} at tick {t}"
  for (m, c), t in where_b.items():
    if c == chunks - 1:
      assert where_f[(m, c)] <= t, f"backward {m} before its forward on the last chunk"
    else:
      assert where_b[(m, c + 1)] == t - 1, f"backward {m} of chunk {c} at tick {t}"
  for s in range(stages):
    live: dict[tuple[int, int], int] = {}
    for t in range(ticks):
      if f[t, s] >= 0:
        slot = int(schedule.forward_slot[t, s])
        assert slot not in live.values() and slot < schedule.num_slots, "slot clash"
        live[int(f[t, s]), int(schedule.forward_chunk[t, s])] = slot
      if b[t, s] >= 0:
        key = (int(b[t, s]), int(schedule.backward_chunk[t, s]))
        assert live.pop(key) == schedule.backward_slot[t, s], "slot mismatch"


_GROUPS = """\
pipeline.num_micro_batch={m} is not a multiple of the {s} pipeline stages. The interleaved
schedule (pipeline.num_virtual_stages={v}) sends micro batches round the ring of stages in
groups of {s}, so that every stage is busy on one of its {v} chunks in every tick. Use
pipeline.num_micro_batch={lo} or {hi} (and a global batch that divides into it), or
pipeline.num_virtual_stages=1."""
