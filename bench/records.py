"""The benchmark records: ``bench/RESULTS.md`` holds the latest run of each bench, one section
per key, and ``bench/RESULTS-archive.md`` every run in date order.

A bench's key is its title, its command line (without ``--record``) and the devices it compiled
for, so a rerun of the same bench on the same kind of machine replaces its section in
RESULTS.md and nothing there is superseded. Pure text in, text out: no jax, so the docs' tests and hooks
read the records without importing the benchmarks.
"""

from __future__ import annotations

import dataclasses
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
CURRENT = os.path.join(HERE, "RESULTS.md")
ARCHIVE = os.path.join(HERE, "RESULTS-archive.md")

CURRENT_HEAD = """# Benchmark results

The latest run of each bench, one section each: `python bench/NAME.py ... --record` replaces
the section of its title, command and devices here and appends the run, dated, to
[RESULTS-archive.md](RESULTS-archive.md), which holds every earlier run in date order. The
figures quoted in the README and the documentation come from these sections
(`tests/test_docs.py` fails when one disagrees). Timings are ratios measured side by side in
one process unless a GPU is named; absolute CPU times on shared 2-core machines are indicative
only.
"""

ARCHIVE_HEAD = """# Benchmark results: every run

Every recorded run in date order, as it was recorded. The latest run of each bench is in
[RESULTS.md](RESULTS.md); a figure here may be superseded by a later section of the same bench.
"""


@dataclasses.dataclass(frozen=True)
class Section:
  """A ``## heading`` of a results file and the text under it (up to the next one)."""
  heading: str
  text: str


def record_key(title: str, command: str, devices: str) -> str:
  """``Automatic plans (bench/auto.py --limit 460000) on XLA:CPU, 8 simulated devices``: the
  title without its parenthesis, the command without ``python`` and ``--record``, the devices
  with their compiler (``common.devices``: XLA:CPU, compile-only H100s, or a GPU timed)."""
  base = re.sub(r"\s*\((?:bench/|\d{4}-)[^)]*\)", "", title).strip()
  words = [w for w in command.split() if w not in ("python", "python3", "--record")]
  return f"{base} ({' '.join(words)}) on {devices}"


def sections(text: str) -> tuple[str, list[Section]]:
  """The head (before the first ``## ``) and the sections of a results file."""
  parts = re.split(r"^## ", text, flags=re.M)
  out = []
  for part in parts[1:]:
    heading, _, body = part.partition("\n")
    out.append(Section(heading.strip(), body))
  return parts[0], out


def join(head: str, found: list[Section]) -> str:
  return head.rstrip("\n") + "\n" + "".join(
      f"\n## {s.heading}\n{s.text.rstrip()}\n" for s in found)


def replace(text: str, section: Section) -> str:
  """``text`` with ``section`` in place of the section of its heading (appended if none)."""
  head, found = sections(text)
  if any(s.heading == section.heading for s in found):
    found = [section if s.heading == section.heading else s for s in found]
  else:
    found.append(section)
  return join(head, found)


def current(key: str, path: str = CURRENT) -> str:
  """The text of the latest record of ``key``; a clear error when RESULTS.md has none."""
  for s in sections(open(path).read())[1]:
    if s.heading == key:
      return s.text
  raise KeyError(f"bench/RESULTS.md has no section '## {key}': run its bench with --record, "
                 "or name one of its headings")


def keys(path: str = CURRENT) -> list[str]:
  return [s.heading for s in sections(open(path).read())[1]]


def write(key: str, stamp: str, body: str) -> None:
  """Records a run: replaces the section ``key`` of RESULTS.md, appends it dated to the
  archive (each file created with its head when missing)."""
  text = open(CURRENT).read() if os.path.exists(CURRENT) else CURRENT_HEAD
  with open(CURRENT, "w") as f:
    f.write(replace(text, Section(key, f"\nRecorded {stamp}. {body.strip()}\n")))
  if not os.path.exists(ARCHIVE):
    with open(ARCHIVE, "w") as f:
      f.write(ARCHIVE_HEAD)
  with open(ARCHIVE, "a") as f:
    f.write(f"\n## {key} ({stamp})\n\n{body.strip()}\n")
