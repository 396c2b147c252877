"""Facts read from a compiled program: its collectives and their bytes.

>>> compiled = trainer.lower(state, batch).compile()            # doctest: +SKIP
>>> summarize(collectives(compiled.as_text()))                  # doctest: +SKIP
{'all-reduce': (1, 8192)}
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from fractions import Fraction

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_LINE = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>\(.*?\)|\S+)\s+"
    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\(", re.M)
_ARRAY = re.compile(r"\b(?P<dtype>pred|[subf]\d+|bf16|f8e\w+|c64|c128)\[(?P<dims>[\d,]*)\]")
# The mesh form of newer XLA may carry its devices' order: ``mesh[...], device_ids=([2,4]T(1,0))
# {'axis_0'}`` (the ids iota([2,4]) transposed, laid over the mesh), kept as one text.
_DEVICE_IDS = r"(?:, device_ids=\((?:[^()]|\([^()]*\))*\))?"
_GROUPS = re.compile(r"replica_groups=(?P<groups>mesh\[.*?\]" + _DEVICE_IDS +
                     r"(?:\s*\{[^}]*\})?|.*?)(?:, [\w_]+=|$)", re.M)
_PAIRS = re.compile(r"source_target_pairs=(?P<pairs>\{\{[\d,{}]*\}\})")
_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of a compiled program: its kind, result shapes and result bytes (and, for a
  ``collective-permute``, its ``source_target_pairs`` text)."""
  kind: str
  shapes: tuple[str, ...]
  bytes: int
  replica_groups: str
  source_target_pairs: str = ""

  def connected(self) -> list[list[int]]:
    """The devices a collective-permute's pairs connect, grouped (its connected components)."""
    group: dict[int, set[int]] = {}
    for a, b in re.findall(r"\{(\d+),(\d+)\}", self.source_target_pairs):
      joined = group.get(int(a), {int(a)}) | group.get(int(b), {int(b)})
      group.update((d, joined) for d in joined)
    return [sorted(g) for g in {id(g): g for g in group.values()}.values()]

  @property
  def group_size(self) -> int | None:
    """Devices in each replica group (1: the collective moves nothing), if it can be read."""
    text = self.replica_groups
    explicit = re.match(r"\{\{([\d,]*)\}", text)
    if explicit:
      return len([d for d in explicit.group(1).split(",") if d])
    iota = re.match(r"\[(\d+),(\d+)\]<=", text)   # [groups, size]<=[...]
    if iota:
      return int(iota.group(2))
    mesh = _mesh_form(text)
    if mesh:
      sizes, inside = mesh
      return math.prod(sizes[d] for d in inside)
    return None

  def device_groups(self, num_devices: int) -> list[list[int]] | None:
    """The partitions of each replica group (``{}``: all of them), or None when the text is
    in a form not read here."""
    text = self.replica_groups.strip()
    if text in ("", "{}"):
      return [list(range(num_devices))]
    if text.startswith("{{"):
      return [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", text)]
    iota = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if iota:   # [groups, size] <= iota over dims, transposed by perm
      shape = [int(d) for d in iota.group(1).split(",")]
      dims = [int(d) for d in iota.group(2).split(",")]
      ids = np.arange(math.prod(dims)).reshape(dims)
      if iota.group(3):
        ids = ids.transpose([int(d) for d in iota.group(3).split(",")])
      return ids.reshape(shape[0], -1).tolist()
    mesh = _mesh_form(text)
    if mesh and math.prod(mesh[0]) == num_devices:   # ids row-major over the mesh axes
      sizes, inside = mesh
      outside = [d for d in range(len(sizes)) if d not in inside]
      ids = _mesh_device_ids(text, num_devices).reshape(sizes).transpose(outside + inside)
      return ids.reshape(-1, math.prod(sizes[d] for d in inside)).tolist()
    return None


def _mesh_form(text: str) -> tuple[list[int], list[int]] | None:
  """``mesh['data'=2,'stage'=2,'model'=2] {'data'}`` (newer XLA) -> (axis sizes, the indices of
  the axes each group spans), or None for another form."""
  mesh = re.match(r"mesh\[(.*?)\]" + _DEVICE_IDS + r"(?:\s*\{(.*?)\})?\s*$", text.strip())
  if not mesh:
    return None
  named = re.findall(r"'(\w+)'=(\d+)", mesh.group(1))
  axes = [a for a, _ in named]
  if mesh.group(2) is None:   # no axes named: one group over every axis (jax 0.10's XLA)
    return [int(n) for _, n in named], list(range(len(axes)))
  return ([int(n) for _, n in named],
          [axes.index(a) for a in re.findall(r"'(\w+)'", mesh.group(2)) if a in axes])


def _mesh_device_ids(text: str, num_devices: int) -> np.ndarray:
  """The device ids of a mesh form in the mesh's row-major order: ``device_ids=([2,4]T(1,0))``
  is iota over dims [2,4] transposed by (1,0); without it, 0..n-1."""
  order = re.search(r"device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)", text)
  if not order:
    return np.arange(num_devices)
  ids = np.arange(num_devices).reshape([int(d) for d in order.group(1).split(",")])
  if order.group(2):
    ids = ids.transpose([int(d) for d in order.group(2).split(",")])
  return ids.reshape(-1)


def _nbytes(dtype: str, dims: str) -> int:
  bits = _BITS.get(dtype) or int(re.sub(r"\D", "", dtype.split("e")[0]) or 8)
  return math.prod(int(d) for d in dims.split(",") if d) * bits // 8


def collectives(hlo_text: str, include_trivial: bool = False) -> list[Collective]:
  """Every collective in ``hlo_text`` (async ``*-start`` forms counted once, by their result).

  Collectives whose replica groups have one device each move nothing (XLA leaves some, e.g.
  a reduction over a mesh axis of size 1); they are left out unless ``include_trivial``.
  """
  found = []
  for m in _LINE.finditer(hlo_text):
    arrays = _result_arrays(m["op"], m["type"]) if m["start"] else _ARRAY.findall(m["type"])
    line_end = hlo_text.find("\n", m.end())
    end = line_end if line_end >= 0 else len(hlo_text)
    groups = _GROUPS.search(hlo_text, m.end(), end)
    pairs = _PAIRS.search(hlo_text, m.end(), end) if m["op"] == "collective-permute" else None
    found.append(Collective(
        m["op"], tuple(f"{d}[{s}]" for d, s in arrays),
        sum(_nbytes(d, s) for d, s in arrays), groups["groups"] if groups else "",
        pairs["pairs"] if pairs else ""))
  return [c for c in found if include_trivial or c.group_size != 1]


def _result_arrays(op: str, start_type: str) -> list[tuple[str, str]]:
  """The result arrays of an async ``*-start``'s type: ``((operands...), results...)`` (XLA:GPU's
  all-reduce-start, all-gather-start), ``(operands..., results..., u32[], u32[])`` (its
  collective-permute-start) or the results alone."""
  if start_type.startswith("(("):
    depth = 0
    for i, ch in enumerate(start_type[1:], 1):
      depth += {"(": 1, ")": -1}.get(ch, 0)
      if depth == 0:
        return _ARRAY.findall(start_type[i + 1:])
  arrays = [a for a in _ARRAY.findall(start_type) if a != ("u32", "")]   # (context scalars)
  if op in ("all-gather", "collective-permute") and len(arrays) >= 2:
    return arrays[len(arrays) // 2:]
  return arrays


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLEE = re.compile(r"\b(?P<kind>body|condition|to_apply|calls)=%?(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
# The older, predicated form: index 0 takes false_computation, as jax numbers a ``lax.cond``.
_PREDICATED = re.compile(r"\b(?P<kind>true_computation|false_computation)=%?(?P<name>[\w.\-]+)")
_OP_NAME = re.compile(r'op_name="(?P<name>[^"]*)"')
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')


@dataclasses.dataclass(frozen=True)
class _Conditional:
  """A ``conditional`` instruction: the computation it stands in, its branches in index
  order and its ``op_name`` (the jax name scopes it was traced under)."""
  caller: str
  branches: tuple[str, ...]
  op_name: str


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None,
                                           dict[str, list[tuple[str, int, str]]]]:
  """(lines of each computation, the entry's name, callee -> [(caller, times, how)])."""
  return _program(hlo_text)[:3]


def _program(hlo_text: str) -> tuple[dict[str, list[str]], str | None,
                                     dict[str, list[tuple[str, int, str]]],
                                     list[_Conditional]]:
  """``_computations`` and the conditionals."""
  bodies: dict[str, list[str]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    head = _COMPUTATION.match(line) if not line.startswith((" ", "\t", "}")) else None
    if head:
      current = head["name"]
      bodies[current] = []
      entry = current if line.startswith("ENTRY") else entry
    elif current is not None and line.startswith("}"):
      current = None
    elif current is not None:
      bodies[current].append(line)
  callers: dict[str, list[tuple[str, int, str]]] = {}
  conditionals: list[_Conditional] = []
  for name, lines in bodies.items():
    for line in lines:
      trips = _TRIPS.search(line)
      for m in _CALLEE.finditer(line):
        times = int(trips["n"]) if trips and m["kind"] in ("body", "condition") else 1
        callers.setdefault(m["name"], []).append((name, times, m["kind"]))
      branches = [callee for m in _BRANCHES.finditer(line)
                  for callee in re.findall(r"%?([\w.\-]+)", m["names"])]
      predicated = {m["kind"]: m["name"] for m in _PREDICATED.finditer(line)}
      if predicated:
        branches = [predicated[k] for k in ("false_computation", "true_computation")
                    if k in predicated]
      if branches:
        op_name = _OP_NAME.search(line)
        conditionals.append(_Conditional(name, tuple(branches), op_name["name"] if op_name
                                         else ""))
        for callee in branches:
          callers.setdefault(callee, []).append((name, 1, "branch"))
  return bodies, entry, callers, conditionals


def executed_collectives(hlo_text: str, include_trivial: bool = False,
                         taken: Mapping[str, Sequence[float]] | None = None
                         ) -> list[Collective]:
  """``collectives``, each as many times as one run of the program executes it on a device.

  A collective inside a ``while`` body (a ``lax.scan`` over layers under ``nn.scan``, the
  pipeline's tick loop, gradient accumulation) runs once per iteration, but stands once in
  the text. Bodies are multiplied by the trip count XLA annotates (``known_trip_count``);
  a loop without one (a data-dependent ``while_loop``) counts once per entry.

  A ``conditional`` runs one of its branches each time it runs. Which one is data, not
  text: by default the branch whose collectives (and what it calls, loops multiplied) move
  the most bytes counts for every run, the most any device can execute. ``taken`` says
  instead, for the conditionals whose ``op_name`` contains a key (a ``jax.named_scope``
  they were traced under), the share of their runs that take each branch on the device
  asked about (a pipeline stage's tick table: ``Pipeline.branch_shares``); a branch left
  out of the shares never runs.
  """
  return executed_on_each(hlo_text, [taken], include_trivial)[0]


def executed_on_each(hlo_text: str, takens: Sequence[Mapping[str, Sequence[float]] | None],
                     include_trivial: bool = False) -> list[list[Collective]]:
  """``executed_collectives`` for each of ``takens`` (a pipeline's stages: the branches each
  device runs), the text read once."""
  bodies, entry, callers, conditionals = _program(hlo_text)
  if entry is None:   # a fragment without computations: every collective once
    return [collectives(hlo_text, include_trivial) for _ in takens]
  own = {name: collectives("\n".join(lines), include_trivial) for name, lines in bodies.items()}
  callees: dict[str, list[tuple[str, int]]] = {}
  for callee, calls in callers.items():
    for caller, times, how in calls:
      if how != "branch":
        callees.setdefault(caller, []).append((callee, times))
  weights: dict[str, int] = {}

  def weight(name: str) -> int:
    """Bytes one run of ``name`` executes, with its conditionals' heaviest branches."""
    if name not in weights:
      weights[name] = 0   # guards against a cycle (none in valid HLO)
      weights[name] = (sum(c.bytes for c in own.get(name, ()))
                       + sum(t * weight(c) for c, t in callees.get(name, ()))
                       + sum(max(map(weight, cond.branches)) for cond in conditionals
                             if cond.caller == name))
    return weights[name]

  def count(taken) -> list[Collective]:   # (as ``executed_collectives`` says)
    share: dict[tuple[str, str], Fraction] = {}   # (conditional's caller, branch) -> its share
    for cond in conditionals:
      given = next((list(v) for k, v in (taken or {}).items() if k in cond.op_name), None)
      if given is None:
        heaviest = max(cond.branches, key=weight)
        given = [float(b == heaviest) for b in cond.branches]
      if len(given) > len(cond.branches):
        raise ValueError(f"taken gives {len(given)} shares to the conditional "
                         f"'{cond.op_name}' of {len(cond.branches)} branches")
      for branch, part in zip(cond.branches, [*given, *[0] * len(cond.branches)]):
        key = (cond.caller, branch)
        share[key] = share.get(key, Fraction(0)) + Fraction(part).limit_denominator(1 << 20)
    runs: dict[str, Fraction] = {entry: Fraction(1)}

    def times_run(name: str) -> Fraction:
      if name not in runs:
        runs[name] = Fraction(0)   # guards against a cycle (none in valid HLO)
        runs[name] = sum((times_run(c) * (share.get((c, name), 0) if how == "branch" else t)
                          for c, t, how in callers.get(name, ())), Fraction(0))
      return runs[name]

    out: list[Collective] = []
    for name, found in own.items():
      n = times_run(name)
      if n.denominator != 1:
        raise ValueError(f"computation {name} runs {n} times: the shares in ``taken`` do not "
                         "divide its conditional's runs")
      out += found * int(n)
    return out

  return [count(taken) for taken in takens]


def computations_in_branches(hlo_text: str, in_loops: bool = False
                             ) -> tuple[dict[str, list[str]], set[str]]:
  """The lines of each computation of ``hlo_text``, and the names of those that run inside a
  branch of a conditional (or in what a branch calls); ``in_loops``: of a conditional that
  itself runs inside a ``while`` body (a pipeline loop's switch, not a step-wide cond)."""
  bodies, _, callers = _computations(hlo_text)

  def walk(start: Callable[[str, str], bool]) -> Callable[[str], bool]:
    seen: dict[str, bool] = {}

    def reached(name: str) -> bool:
      if name not in seen:
        seen[name] = False   # guards against a cycle
        seen[name] = any(start(c, how) or reached(c) for c, _, how in callers.get(name, ()))
      return seen[name]
    return reached

  in_loop = walk(lambda caller, how: how == "body")
  in_branch = walk(lambda caller, how: how == "branch" and (not in_loops or in_loop(caller)))
  return bodies, {name for name in bodies if in_branch(name)}


def collectives_in_branches(hlo_text: str, in_loops: bool = False) -> list[Collective]:
  """The collectives of ``hlo_text`` that run inside a branch of a conditional (or in what a
  branch calls): only the devices that take that branch reach them. ``in_loops``: as in
  ``computations_in_branches``."""
  bodies, inside = computations_in_branches(hlo_text, in_loops)
  return [c for name, lines in bodies.items() if name in inside
          for c in collectives("\n".join(lines))]


def summarize(found: Iterable[Collective]) -> dict[str, tuple[int, int]]:
  """{kind: (count, total result bytes)} in a fixed order."""
  out: dict[str, tuple[int, int]] = {}
  for c in found:
    n, b = out.get(c.kind, (0, 0))
    out[c.kind] = (n + 1, b + c.bytes)
  return {k: out[k] for k in KINDS if k in out}


_MATMUL = re.compile(r"stablehlo\.(?:dot_general|dot|convolution)\b[^\n]*?:\s*"
                     r"\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)")


def float32_matmuls(stablehlo_text: str) -> int:
  """Matmuls and convolutions with a float32 operand in a lowered program
  (``jitted.lower(...).as_text()``): what mixed precision O1 should leave at 0."""
  return sum(any(t.endswith("xf32>") or t == "tensor<f32>" for t in m.groups())
             for m in _MATMUL.finditer(stablehlo_text))


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>\(.*?\)|\S+)\s+"
                          r"(?P<op>[\w\-]+)\((?P<operands>[^)]*)\)", re.M)


def conditional_result_bytes(hlo_text: str) -> int:
  """Bytes of the results of every ``conditional`` of a compiled program.

  ``cost_analysis()["bytes accessed"]`` counts a conditional's results on top of the branch it
  takes as the most expensive, which writes them itself (the branch's buffers are the
  conditional's: nothing is copied). Subtracting this counts each byte once; checked on the
  data-parallel step, where a ``lax.cond`` around the update adds exactly these bytes.
  """
  return sum(_nbytes(a["dtype"], a["dims"])
             for m in _INSTRUCTION.finditer(hlo_text) if m["op"] == "conditional"
             for a in _ARRAY.finditer(m["type"]))
