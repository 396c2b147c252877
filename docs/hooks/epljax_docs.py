"""mkdocs hooks of the epljax site (``hooks:`` in mkdocs.yml).

- The configuration reference is generated from ``epljax/config/schema.py`` at build time:
  ``<!-- config-reference -->`` in a page becomes one table per section (key, type or allowed
  values, default, meaning), so the page cannot drift from the schema.
- ``notebook.md`` is generated from ``examples/notebook.ipynb`` with the outputs saved in it
  (plans as HTML tables, the progress bars' last state, plots), which tests/test_notebook.py
  keeps equal to what the notebook prints today.
- Figures come from the benchmark records (``bench/RESULTS.md``): ``<!-- include: KEY -->``
  in a page becomes the record's text (or a subsection of it, or its first table's first
  rows) when the site builds, so a re-recorded bench needs no edit of the page; the record
  blocks of the README (which GitHub shows as written) are rewritten by ``sync``.
- The pages link to the repository's examples and benchmarks as GitHub shows them
  (``../examples/quickstart.py``); the site carries those files too (examples/, bench/, with
  ``bench/RESULTS.md`` as a page), and the links are rewritten to point there.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import typing

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARKER = "<!-- config-reference -->"
NOTEBOOK_PAGE = "notebook.md"     # examples/notebook.ipynb with its saved outputs, as a page
# Repository files the site carries, as globs relative to the repository root.
CARRIED = ("examples/*.py", "examples/*.ipynb", "bench/*.py", "bench/RESULTS.md",
           "bench/RESULTS-archive.md")
# The pages that explain each section: (title, link) pairs, flat (tests/test_docs.py checks
# that every section of the schema has one).
EXPLAINED = {
    "pipeline": ("Pipeline parallelism", "pipeline.md"),
    "gradient_checkpoint": ("Memory features", "memory.md"),
    "zero": ("Memory features", "memory.md"),
    "offload": ("Memory features", "memory.md"),
    "amp": ("Memory features", "memory.md"),
    "optimizer": ("Memory features", "memory.md"),
    "cluster": ("Devices and placement", "concepts.md#devices-and-placement"),
    "communication": ("Communication options", "data-parallel.md#communication-options"),
    "io": ("Input files", "launching.md#input-files-io"),
    "auto": ("Automatic plans", "automatic-plans.md",
             "Automatic stages", "pipeline.md#automatic-stages-autoauto_parallel"),
    "context": ("Long sequences", "long-sequences.md"),
}


def on_files(files, config):
  for pattern in CARRIED:
    for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
      uri = os.path.relpath(path, ROOT).replace(os.sep, "/")
      if files.get_file_from_path(uri) is None:
        files.append(File.generated(config, uri, abs_src_path=path))
  files.append(File.generated(config, NOTEBOOK_PAGE, content=notebook_markdown(
      os.path.join(ROOT, "examples", "notebook.ipynb"))))
  return files


def on_page_markdown(markdown, page, config, files):
  depth = page.file.src_uri.count("/")
  if depth == 0:   # a page of docs/: ../examples/x.py (right on GitHub) is examples/x.py here
    markdown = re.sub(r"\]\(\.\./((?:examples|bench)/[^)\s]+)\)", r"](\1)", markdown)
  if MARKER in markdown:
    markdown = markdown.replace(MARKER, config_reference())
  return include(sync(markdown))


def config_reference() -> str:
  """Every key of the schema: one Markdown table per section."""
  from epljax.config.schema import SECTIONS

  out = []
  for section, cls in SECTIONS.items():
    hints = typing.get_type_hints(cls)
    out += [f"### `{section}`", ""]
    if _own_doc(cls):
      out += [cls.__doc__.strip(), ""]
    if section in EXPLAINED:
      pages = EXPLAINED[section]
      links = [f"[{t}]({u})" for t, u in zip(pages[::2], pages[1::2])]
      out += [f"Explained in {' and '.join(links)}.", ""]
    out += ["| key | type / allowed values | default | what it does |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
      allowed = field.metadata["allowed"]
      kind = (" / ".join(f"`{a!r}`" for a in allowed) if allowed
              else f"`{_type_name(hints[field.name])}`")
      if field.metadata.get("minimum") is not None:
        kind += f", at least `{field.metadata['minimum']}`"
      env = f"EPL_{section.upper()}_{field.name.upper()}"
      doc = field.metadata["doc"].replace("|", "\\|")
      out.append(f"| `{section}.{field.name}` | {kind} | `{field.default!r}` | {doc} "
                 f"(env `{env}`) |")
    out.append("")
  return "\n".join(out)


def _own_doc(cls) -> bool:
  # A dataclass without a docstring gets a generated one ("PipelineConfig(num_micro_batch...").
  return bool(cls.__doc__) and not cls.__doc__.startswith(cls.__name__ + "(")


def _type_name(hint) -> str:
  if isinstance(hint, type):
    return hint.__name__
  return str(hint).replace("typing.", "").replace("NoneType", "None")


# --- Figures from the benchmark records (bench/RESULTS.md) ----------------------------------
# <!-- record: KEY § SUBSECTION, rows N --> ... <!-- /record -->: the lines between are the
# record's (sub)section up to its N-th table row, rewritten by ``sync`` (README and pages alike,
# so GitHub shows them too); tests/test_docs.py fails when a page is not its own ``sync``.
# A marker in a code span (`<!-- include: KEY -->`) is text, not a marker.
# <!-- include: KEY § SUBSECTION, rows N -->: the same excerpt, put in place of the marker when
# the site builds (the page's source holds only the marker).
# <!-- figures: KEY; KEY --> ... <!-- /figures -->: every figure between (a number with a unit:
# 1.02x, 0.4 ms, 14.44 MiB, 6-8x, 22%; code spans aside) must be in those records; a measured
# figure (a decimal with a unit) outside both kinds of block fails too.
RECORD = re.compile(r"(?<!`)(<!-- record: (?P<key>.+?)(?: § (?P<sub>.+?))?"
                    r"(?:, rows (?P<rows>\d+))? -->\n)(?P<body>.*?)(<!-- /record -->)", re.S)
INCLUDE = re.compile(r"(?<!`)<!-- include: (?P<key>.+?)(?: § (?P<sub>.+?))?"
                     r"(?:, rows (?P<rows>\d+))? -->")
FIGURES = re.compile(r"(?<!`)<!-- figures: (?P<keys>.+?) -->(?P<body>.*?)<!-- /figures -->", re.S)
NUMBER = r"\d+\.\d+"
UNIT = r"(?:[x×]|\s?(?:ms|us|µs|s|%|KiB|MiB|GiB|kB|KB|MB|GB|kchars))(?![\w])"
FIGURE = re.compile(rf"(?<![\w.]){NUMBER}(?:\s?[-–]\s?{NUMBER})?{UNIT}")
# Inside a figures block whole numbers count too (6-8x, 22%, 95 s): all of them are quoted.
ANY_FIGURE = re.compile(rf"(?<![\w.])\d+(?:\.\d+)?(?:\s?[-–]\s?\d+(?:\.\d+)?)?{UNIT}")


def records_module():
  """bench/records.py, loaded by path (bench/ is not a package)."""
  import importlib.util
  import sys

  if "epljax_bench_records" in sys.modules:
    return sys.modules["epljax_bench_records"]
  spec = importlib.util.spec_from_file_location("epljax_bench_records",
                                                os.path.join(ROOT, "bench", "records.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


def excerpt(key: str, sub: str | None, rows: int | None) -> str:
  """The record's text (its ``### sub`` subsection); with ``rows``, up to its first table,
  cut after that table's ``rows``-th row."""
  text = records_module().current(key)
  if sub:
    parts = re.split(r"^### ", text, flags=re.M)
    found = [p for p in parts[1:] if p.split("\n", 1)[0].strip() == sub]
    if not found:
      raise KeyError(f"bench/RESULTS.md, section '{key}', has no '### {sub}'")
    text = found[0].split("\n", 1)[1]
  out, seen = [], 0
  for line in text.strip("\n").split("\n"):
    if rows is not None and line.startswith("|") and not line.startswith("|-"):
      seen += 1
      if seen > rows + 1:           # the header row, then ``rows`` rows
        break
    elif rows is not None and seen and not line.startswith("|"):
      break                         # the end of the first table
    out.append(line)
  return "\n".join(out).strip("\n") + "\n"


def sync(text: str) -> str:
  """``text`` with each record block regenerated from bench/RESULTS.md."""
  def one(m):
    rows = int(m.group("rows")) if m.group("rows") else None
    return m.group(1) + excerpt(m.group("key"), m.group("sub"), rows) + m.group(6)
  return RECORD.sub(one, text)


def include(text: str) -> str:
  """``text`` with each include marker replaced by its record's excerpt."""
  def one(m):
    rows = int(m.group("rows")) if m.group("rows") else None
    return excerpt(m.group("key"), m.group("sub"), rows).rstrip("\n")
  return INCLUDE.sub(one, text)


def quoted_keys(text: str) -> list[str]:
  """The records a page quotes: its record, include and figures markers' keys, in order."""
  out = [m.group("key") for m in RECORD.finditer(text)]
  out += [m.group("key") for m in INCLUDE.finditer(text)]
  out += [k.strip() for m in FIGURES.finditer(text) for k in m.group("keys").split(";")]
  return list(dict.fromkeys(out))


def _code_free(text: str) -> str:
  """The text with fenced code blocks blanked (line numbers kept)."""
  return re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)


def figure_errors(text: str) -> list[str]:
  """Each measured figure of ``text`` that its records do not hold, or that no block covers."""
  errors = []
  current = records_module().current
  for m in FIGURES.finditer(text):
    held = "\n".join(current(k.strip()) for k in m.group("keys").split(";"))
    for fig in ANY_FIGURE.finditer(re.sub(r"`[^`]*`", "", m.group("body"))):
      for number in re.findall(r"\d+(?:\.\d+)?", fig.group(0)):
        if not re.search(rf"(?<![\d.]){re.escape(number)}(?!\d)", held):
          line = text.count("\n", 0, m.start("body") + fig.start()) + 1
          errors.append(f"line {line}: {fig.group(0)!r} is in no record of {m.group('keys')}")
  rest = RECORD.sub(lambda m: "\n" * m.group(0).count("\n"), text)
  rest = FIGURES.sub(lambda m: "\n" * m.group(0).count("\n"), rest)
  rest = _code_free(re.sub(r"<!--.*?-->", "", rest, flags=re.S))
  rest = re.sub(r"`[^`\n]*`", "", rest)             # code spans: literal text, not claims
  for fig in FIGURE.finditer(rest):
    line = rest.count("\n", 0, fig.start()) + 1
    errors.append(f"line {line}: {fig.group(0)!r} is quoted outside a figures or record block")
  return errors


def sync_files() -> None:
  """Rewrites the record blocks of the README and every page from bench/RESULTS.md."""
  for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [
      os.path.join(ROOT, "README.md")]:
    text = open(path).read()
    if sync(text) != text:
      with open(path, "w") as f:
        f.write(sync(text))


if __name__ == "__main__":
  sync_files()


# --- The notebook as a page ---------------------------------------------------------------
def notebook_markdown(path: str) -> str:
  """The notebook's cells in order: Markdown as it is, code as Python blocks, each output as
  what Jupyter shows (HTML, PNG images inline, a progress bar from its saved widget state,
  text)."""
  import html
  import json

  notebook = json.load(open(path))
  widgets = notebook.get("metadata", {}).get("widgets", {}).get(
      "application/vnd.jupyter.widget-state+json", {}).get("state", {})
  link = "[examples/notebook.ipynb](examples/notebook.ipynb)"
  out = ["<!-- generated from examples/notebook.ipynb by docs/hooks/epljax_docs.py -->\n",
         f"*This page is {link} with the outputs saved in it (`tests/test_notebook.py` checks "
         "them against a fresh run).*\n"]
  for cell in notebook["cells"]:
    source = "".join(cell["source"])
    if cell["cell_type"] == "markdown":
      out.append(source + "\n")
      continue
    out.append(f"```python\n{source}\n```\n")
    for o in cell.get("outputs", []):
      data = o.get("data", {})
      if o["output_type"] == "stream":
        out.append(f"```text\n{''.join(o['text']).rstrip()}\n```\n")
      elif "application/vnd.jupyter.widget-view+json" in data:
        out.append(_bar(widgets, data["application/vnd.jupyter.widget-view+json"]["model_id"],
                        "".join(data.get("text/plain", ""))))
      elif "image/png" in data:
        png = "".join(data["image/png"]).replace("\n", "")
        out.append(f'<img alt="output" src="data:image/png;base64,{png}">\n')
      elif "text/html" in data:
        out.append(f'<div class="epljax-output">\n{"".join(data["text/html"])}\n</div>\n')
      elif "text/plain" in data:
        out.append(f"```text\n{html.unescape(''.join(data['text/plain'])).rstrip()}\n```\n")
  return "\n".join(out)


def _bar(widgets: dict, model_id: str, fallback: str) -> str:
  """A tqdm widget's last state: its text before and after, and the bar as ``<progress>``."""
  box = widgets.get(model_id, {}).get("state", {})
  parts = []
  for child in box.get("children", []):
    state = widgets.get(child.replace("IPY_MODEL_", ""), {}).get("state", {})
    if "max" in state:
      parts.append(f'<progress value="{state["value"]}" max="{state["max"]}"></progress>')
    else:
      parts.append(state.get("value", ""))
  if not parts:
    return f"```text\n{fallback}\n```\n"
  return f'<div class="epljax-bar"><code>{" ".join(parts)}</code></div>\n'
