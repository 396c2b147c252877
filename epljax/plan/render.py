"""The plan's ``(title, blocks)`` sections as text (``print(plan)``) and as HTML (Jupyter).

A block is a line of text (``"mesh      data=8 x ..."``: a short label, two spaces or more, the
text) or a table ``(headers, rows)``; both renderings keep the sections' order.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from html import escape
from typing import Any


def render_text(sections: Sequence[tuple[str, list[Any]]]) -> str:
  """``(title, blocks)`` sections (``Plan.sections``) as the text ``print(plan)`` shows."""
  lines = []
  for i, (title, blocks) in enumerate(sections):
    lines += ([""] if i else []) + [title]
    for block in blocks:
      lines += [f"  {block}"] if isinstance(block, str) else _table(*block)
  return "\n".join(lines)


def html_plan(sections: Sequence[tuple[str, Sequence[Any]]]) -> str:
  """``Plan.sections()`` as HTML: a heading per section, its tables as tables, and its lines
  as a two-column table of label (``mesh``, ``schedule`` ...) and text."""
  out = ['<div class="epljax-plan">']
  for title, blocks in sections:
    out.append(f"<h4>{escape(title)}</h4>")
    lines: list[str] = []
    for block in [*blocks, None]:
      if isinstance(block, str):
        label, text = _label(block)
        lines.append(f"<tr><th style=\"text-align:left\">{escape(label)}</th>"
                     f"<td style=\"text-align:left\">{escape(text)}</td></tr>")
        continue
      if lines:
        out.append("<table>" + "".join(lines) + "</table>")
        lines = []
      if block is not None:
        headers, rows = block
        out.append("<table><thead><tr>" + "".join(
            f"<th style=\"text-align:left\">{escape(str(h))}</th>" for h in headers)
            + "</tr></thead><tbody>" + "".join(
            "<tr>" + "".join(f"<td style=\"text-align:left\"><code>{escape(str(c))}</code></td>"
                             for c in row) + "</tr>" for row in rows) + "</tbody></table>")
  return "\n".join(out + ["</div>"])


def _label(line: str) -> tuple[str, str]:
  """``"schedule  PreferBackward ..."`` -> ``("schedule", "PreferBackward ...")``; a line
  without a short label first comes back whole."""
  match = re.match(r"([a-z][a-z ]{0,9}?)  +(\S.*)", line)
  return (match.group(1), match.group(2)) if match else ("", line)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
  cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
  return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
