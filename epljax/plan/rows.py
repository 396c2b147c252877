"""The variables table of ``print(trainer.plan)``: one row per leaf (``full``), or one row per
stack of layers, so a deep model's table stays as short as a shallow one's.

A stack is either the leaves of one scanned stack (``nn.scan``: a leading layer axis that every
use, inside the scan, slices; found in the traced program, ``scanned``) or the leaves of
numbered sibling blocks (``h_0`` ... ``h_23``) whose leaves have the same shapes, dtypes and
specs. Anything else keeps its own row.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import PartitionSpec as P

from epljax.errors import size

HEADERS = ["path", "shape", "dtype", "spec", "bytes/device", "task graph", "why"]


def scanned(program, leaves: Sequence[Any]) -> dict[int, tuple[int, int]]:
  """Leaf index -> (the scan that reads it, its length) for the leaves of a scanned stack:
  every use sits inside a scan whose trips the leaf's leading axis divides."""
  out = {}
  for i, leaf in enumerate(leaves):
    uses = program.uses_of_input(i) if i < len(program.invars) else []
    if not uses or not leaf.shape or leaf.shape[0] < 2:
      continue
    scans = {n.enclosing_ids[n.enclosing.index("scan")] for n, _ in uses if "scan" in n.enclosing}
    if (len(scans) == 1 and all("scan" in n.enclosing and n.trips % leaf.shape[0] == 0
                                for n, _ in uses)):
      out[i] = (scans.pop(), leaf.shape[0])
  return out


def variable_rows(leaves: Sequence[Any], stacks: Mapping[int, tuple[int, int]],
                  full: bool = False) -> list[list[Any]]:
  """The table's rows: every leaf with ``full``, else a stack (``stacks``: ``scanned``'s
  answer, and numbered blocks) as one row."""
  if full:
    return [leaf_row(leaf) for leaf in leaves]
  groups: dict[Any, list[int]] = {}
  for i, leaf in enumerate(leaves):
    if i in stacks:
      key: Any = ("scan", stacks[i], leaf.trainable)
    else:
      block = _numbered(leaf.path)
      key = ("blocks", block[0], leaf.trainable) if block else ("leaf", i)
    groups.setdefault(key, []).append(i)
  rows = []
  for key, members in sorted(groups.items(), key=lambda kv: kv[1][0]):
    group = [leaves[i] for i in members]
    if key[0] == "scan" and len(group) > 1:
      rows.append(_stack_row(group, f"{key[1][1]} layers x {len(group)} leaves",
                             _common(leaf.path for leaf in group) + "/*"))
    elif key[0] == "blocks" and _same_blocks(group):
      numbers = sorted({_numbered(leaf.path)[1] for leaf in group})
      head = key[1].replace("{N}", "{" + _numbers(numbers) + "}")
      rows.append(_stack_row(group, f"{len(numbers)} blocks x {len(group) // len(numbers)} "
                             "leaves", head + "/*"))
    else:
      rows += [leaf_row(leaf) for leaf in group]
  return rows


def leaf_row(leaf) -> list[Any]:
  return [leaf.path + ("" if leaf.trainable else "  (state)"), leaf.shape, leaf.dtype,
          spec_text(leaf.spec), size(leaf.bytes_per_device), leaf.taskgraph, leaf.rule]


def spec_text(spec: P) -> str:
  return "P(" + ", ".join(repr(a) for a in spec) + ")"


def _stack_row(group: list[Any], shape: str, path: str) -> list[Any]:
  specs = {spec_text(leaf.spec) for leaf in group}
  leads = {tuple(leaf.spec)[:1] for leaf in group}
  spec = (specs.pop() if len(specs) == 1 else
          f"P({leads.pop()[0]!r}, ...)" if len(leads) == 1 and () not in leads else "(per leaf)")
  rules = {leaf.rule for leaf in group}
  heads = {r.split(":")[0] for r in rules}
  why = (rules.pop() if len(rules) == 1 else
         f"{heads.pop()}: ... (per leaf: full=True)" if len(heads) == 1 else "(per leaf)")
  return [path + ("" if group[0].trainable else "  (state)"), shape,
          "/".join(sorted({leaf.dtype for leaf in group})), spec,
          size(sum(leaf.bytes_per_device for leaf in group)),
          "/".join(sorted({leaf.taskgraph for leaf in group})), why]


def _numbered(path: str) -> tuple[str, int, str] | None:
  """``params/h_3/attn/kernel`` -> (``params/h_{N}``, 3, ``attn/kernel``): the first numbered
  component below the top one; None without one."""
  parts = path.split("/")
  for j in range(1, len(parts) - 1):
    match = re.fullmatch(r"(.*?)(\d+)", parts[j])
    if match:
      head = "/".join(parts[:j] + [match.group(1) + "{N}"])
      return head, int(match.group(2)), "/".join(parts[j + 1:])
  return None


def _same_blocks(group: list[Any]) -> bool:
  """Two blocks or more, each with the same leaves (path below the number, shape, dtype,
  spec)."""
  blocks: dict[int, list] = {}
  for leaf in group:
    _, number, rest = _numbered(leaf.path)
    blocks.setdefault(number, []).append((rest, leaf.shape, leaf.dtype, tuple(leaf.spec)))
  kinds = {tuple(sorted(b, key=repr)) for b in blocks.values()}
  return len(blocks) > 1 and len(kinds) == 1


def _numbers(numbers: list[int]) -> str:
  if numbers == list(range(numbers[0], numbers[-1] + 1)):
    return f"{numbers[0]}..{numbers[-1]}"
  return ",".join(map(str, numbers))


def _common(paths) -> str:
  return os.path.commonpath(list(paths)) or "*"
