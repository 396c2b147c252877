"""mkdocs hooks of the epljax site (``hooks:`` in mkdocs.yml).

- The configuration reference is generated from ``epljax/config/schema.py`` at build time:
  ``<!-- config-reference -->`` in a page becomes one table per section (key, type or allowed
  values, default, meaning), so the page cannot drift from the schema.
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
# Repository files the site carries, as globs relative to the repository root.
CARRIED = ("examples/*.py", "examples/*.ipynb", "bench/*.py", "bench/RESULTS.md")
# The page that explains each section (a section missing here just gets no link).
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
    "auto": ("Automatic stages", "pipeline.md#automatic-stages-autoauto_parallel"),
}


def on_files(files, config):
  for pattern in CARRIED:
    for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
      uri = os.path.relpath(path, ROOT).replace(os.sep, "/")
      if files.get_file_from_path(uri) is None:
        files.append(File.generated(config, uri, abs_src_path=path))
  return files


def on_page_markdown(markdown, page, config, files):
  depth = page.file.src_uri.count("/")
  if depth == 0:   # a page of docs/: ../examples/x.py (right on GitHub) is examples/x.py here
    markdown = re.sub(r"\]\(\.\./((?:examples|bench)/[^)\s]+)\)", r"](\1)", markdown)
  if MARKER in markdown:
    markdown = markdown.replace(MARKER, config_reference())
  return markdown


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
      out += [f"Explained in [{EXPLAINED[section][0]}]({EXPLAINED[section][1]}).", ""]
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
