"""The documentation site: it builds with ``mkdocs build --strict``, every Python block of its
pages (and of the README) runs or says why it cannot, the configuration reference holds every
key of the schema, and the troubleshooting page every ``EPLError``."""

from __future__ import annotations

import dataclasses
import glob
import importlib
import importlib.util
import os
import pkgutil
import re
import subprocess
import sys

import pytest

import epljax as epl
from epljax.config.schema import SECTIONS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, "docs")
PAGES = sorted(glob.glob(os.path.join(DOCS, "*.md"))) + [os.path.join(REPO, "README.md")]
# A fenced Python block, and the HTML comment that may stand right before it (blank lines
# allowed in between): <!-- not run: the reason -->.
BLOCK = re.compile(r"(?:<!--\s*not run:(?P<reason>[^>]*)-->\s*\n)?(?P<indent>[ \t]*)```python\n"
                   r"(?P<code>.*?)\n(?P=indent)```", re.S)


def python_blocks(path):
  """(line, code, reason) of each ```python block; reason is None for a block to run."""
  text = open(path).read()
  out = []
  for m in BLOCK.finditer(text):
    indent = m.group("indent")
    code = "\n".join(line[len(indent):] for line in m.group("code").split("\n"))
    reason = m.group("reason")
    out.append((text.count("\n", 0, m.start("indent")) + 1, code,
                None if reason is None else reason.strip()))
  return out


def load_hooks():
  spec = importlib.util.spec_from_file_location(
      "epljax_docs", os.path.join(DOCS, "hooks", "epljax_docs.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_site_builds_strict(tmp_path):
  done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                         "-f", os.path.join(REPO, "mkdocs.yml"), "-d", str(tmp_path / "site")],
                        cwd=REPO, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout + done.stderr
  config = open(tmp_path / "site" / "config" / "index.html").read()
  assert "pipeline.num_micro_batch" in config and "gradients_reduce_method" in config
  api = open(tmp_path / "site" / "api" / "index.html").read()
  # Every public name has its entry, rendered from Google-style docstrings (parameter tables,
  # no literal "Args:"), with the warnings, the Plan's fields and Checkpointer.close.
  ids = set(re.findall(r'id="(epljax\.[\w.]+)"', api))
  names = [f"epljax.{n}" for n in epl.__all__] + [
      "epljax.Checkpointer.close", "epljax.Plan.num_replicas", "epljax.Plan.param_specs",
      "epljax.Plan.search", "epljax.errors.PipelineWarning",
      "epljax.pipeline.auto.StageBalanceWarning"]
  assert not [n for n in names if n not in ids], [n for n in names if n not in ids]
  assert "Args:" not in api and "Parameters" in api
  for page, text in (("tutorial", "2 hosts x 8 GPUs"), ("migrating", "SHARD_GRAD_OP")):
    assert text in open(tmp_path / "site" / page / "index.html").read(), page
  plans = open(tmp_path / "site" / "automatic-plans" / "index.html").read()
  assert "<!-- include:" not in plans and plans.count("Recorded 20") >= 3   # records included
  notebook = open(tmp_path / "site" / "notebook" / "index.html").read()
  assert notebook.count("epljax-plan") >= 3 and "data:image/png;base64," in notebook
  assert '<div class="epljax-bar">' in notebook           # the bars' last state


def test_the_config_reference_is_generated_from_every_key_of_the_schema():
  text = load_hooks().config_reference()
  for section, cls in SECTIONS.items():
    for field in dataclasses.fields(cls):
      row = next((line for line in text.split("\n")
                  if line.startswith(f"| `{section}.{field.name}` |")), None)
      assert row is not None, f"{section}.{field.name} is missing"
      assert f"`{field.default!r}`" in row and field.metadata["doc"][:30] in row.replace(
          "\\|", "|"), row


def test_every_section_of_the_config_reference_links_to_its_pages():
  hooks = load_hooks()
  assert set(hooks.EXPLAINED) == set(SECTIONS)
  text = hooks.config_reference()
  for section, pages in hooks.EXPLAINED.items():
    block = text.split(f"### `{section}`")[1].split("### ")[0]
    for title, link in zip(pages[::2], pages[1::2]):
      assert f"[{title}]({link})" in block, section
      assert os.path.exists(os.path.join(DOCS, link.split("#")[0])), link


def _error_classes():
  """Every EPLError subclass of the package (every module imported, but no ``__main__``)."""
  for info in pkgutil.walk_packages(epl.__path__, "epljax."):
    if not info.name.endswith("__main__"):
      importlib.import_module(info.name)
  found, todo = set(), [epl.EPLError]
  while todo:
    cls = todo.pop()
    found.add(cls)
    todo += cls.__subclasses__()
  return sorted(c.__name__ for c in found if c.__module__.startswith("epljax"))


def test_the_troubleshooting_page_lists_every_eplerror():
  text = open(os.path.join(DOCS, "troubleshooting.md")).read()
  headings = set(re.findall(r"^## (\w+)$", text, re.M))
  names = _error_classes()
  assert {"ConfigError", "PlanError", "LaunchError", "FusedLayoutError"} <= set(names)
  missing = [n for n in names if n not in headings]
  assert not missing, f"docs/troubleshooting.md has no '## Name' section for {missing}"


def test_every_python_block_is_run_or_says_why_not():
  for path in PAGES:
    for line, _, reason in python_blocks(path):
      assert reason is None or reason, (
          f"{os.path.relpath(path, REPO)}:{line}: '<!-- not run: -->' needs a reason")


@pytest.mark.parametrize("path", [p for p in PAGES if any(
    r is None for _, _, r in python_blocks(p))], ids=lambda p: os.path.relpath(p, REPO))
def test_the_python_blocks_of_a_page_run(path, tmp_path, monkeypatch):
  """A page's runnable blocks run in order in one namespace (as a reader would paste them), in
  a temporary directory (checkpoints, event files), on the 8 test devices."""
  monkeypatch.chdir(tmp_path)
  namespace = {"__name__": "__docs__"}
  for line, code, reason in python_blocks(path):
    if reason is not None:
      continue
    try:
      # dont_inherit: this file's `from __future__ import annotations` must not reach the page
      exec(compile(code, f"{os.path.relpath(path, REPO)}:{line}", "exec", dont_inherit=True),
           namespace)
    except Exception as error:
      raise AssertionError(f"{os.path.relpath(path, REPO)}, the block at line {line} "
                           f"failed: {type(error).__name__}: {error}") from error


def test_every_figure_of_the_docs_is_in_the_latest_record_of_its_bench():
  """A measured figure (1.02x, 0.4 ms, 14.44 MiB) stands in a ``figures`` block naming the
  records that hold it, or in a ``record`` block generated from one; either way it must be in
  the latest section of its bench in bench/RESULTS.md."""
  hooks = load_hooks()
  errors = [f"{os.path.relpath(p, REPO)}: {e}" for p in PAGES
            for e in hooks.figure_errors(open(p).read())]
  assert not errors, "\n".join(errors)


def test_record_blocks_are_the_records():
  """The tables copied from bench/RESULTS.md are today's: a page equals its own ``sync``."""
  hooks = load_hooks()
  stale = [os.path.relpath(p, REPO) for p in PAGES if hooks.sync(open(p).read()) !=
           open(p).read()]
  assert not stale, (f"{stale}: a record block differs from bench/RESULTS.md; regenerate with "
                     "python docs/hooks/epljax_docs.py")


def test_include_markers_name_records_and_the_site_fills_them():
  """``<!-- include: KEY ... -->`` in a page: the record exists (with its subsection) and the
  page the site builds holds its text in place of the marker."""
  hooks = load_hooks()
  found = 0
  for path in PAGES:
    text = open(path).read()
    for m in hooks.INCLUDE.finditer(text):
      found += 1
      rows = int(m.group("rows")) if m.group("rows") else None
      excerpt = hooks.excerpt(m.group("key"), m.group("sub"), rows)
      assert excerpt.strip() in hooks.include(m.group(0)), os.path.relpath(path, REPO)
  assert found
  key = hooks.records_module().keys()[0]
  table = "\n".join(line for line in hooks.excerpt(key, None, None).split("\n")
                    if line.startswith("|"))
  page = hooks.on_page_markdown(f"before\n\n<!-- include: {key}, rows 1 -->\n\nafter\n",
                                _Page("x.md"), None, None)
  assert table.split("\n")[2] in page and "<!-- include" not in page


@dataclasses.dataclass
class _File:
  src_uri: str


class _Page:
  def __init__(self, uri):
    self.file = _File(uri)


def test_every_quoted_record_names_a_bench_that_reruns_it():
  """bench/run.py's map: each record a page quotes names a bench script (and pipeline.py
  subcommand) that exists, so ``run.py --headline`` can rewrite it."""
  spec = importlib.util.spec_from_file_location("epljax_bench_run",
                                                os.path.join(REPO, "bench", "run.py"))
  run = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = run             # (its dataclass looks its module up)
  spec.loader.exec_module(run)
  benches = run.quoted()
  assert len({b.name for b in benches}) == len(benches) > 20
  for b in benches:
    script = os.path.join(REPO, b.argv[1])
    assert os.path.exists(script), (b.key, b.argv)
    if b.argv[1] == "bench/pipeline.py":
      assert f'"{b.argv[2]}"' in open(script).read(), b.argv
  assert {b.needs for b in benches} == {"cpu", "cuda-plugin", "gpu"}


def test_a_figure_no_record_holds_fails():
  hooks = load_hooks()
  key = hooks.records_module().keys()[0]
  assert hooks.figure_errors(f"<!-- figures: {key} -->\nit ran 123.456x faster\n"
                             "<!-- /figures -->\n")
  assert hooks.figure_errors("it ran 1.5x faster, unsourced\n")
  assert not hooks.figure_errors("1.5 times the mean, a rule and not a measurement\n")


def test_a_record_replaces_its_bench_and_keeps_the_others(tmp_path):
  records = load_hooks().records_module()
  key = records.record_key("Automatic plans (bench/auto.py)",
                           "python bench/auto.py --limit 460000 --record",
                           "XLA:CPU, 8 simulated devices")
  assert key == "Automatic plans (bench/auto.py --limit 460000) on XLA:CPU, 8 simulated devices"
  text = records.CURRENT_HEAD + "\n## a\n\nold a\n\n## b\n\nb\n"
  text = records.replace(text, records.Section("a", "\nnew a\n"))
  text = records.replace(text, records.Section("c", "\nc\n"))
  assert [s.heading for s in records.sections(text)[1]] == ["a", "b", "c"]
  assert "new a" in text and "old a" not in text


def test_every_record_names_its_compiler():
  """A record's heading ends with the devices it compiled for: XLA:CPU's simulated devices,
  compile-only H100s (XLA:GPU, nothing run), or a real GPU it was timed on."""
  compiler = re.compile(r" on (XLA:CPU, \d+ simulated devices?|(\d+ )?compile-only H100s"
                        r"|XLA:GPU, \d+ x NVIDIA \w.*)$")
  records = load_hooks().records_module()
  wrong = [k for k in records.keys() if not compiler.search(k)]
  assert not wrong, wrong


def _resolves(dotted: str) -> bool:
  """``epljax.a.b.C`` names a module or an attribute of one."""
  parts = dotted.split(".")
  for cut in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:cut]))
    except ImportError:
      continue
    try:
      for name in parts[cut:]:
        obj = getattr(obj, name)
    except AttributeError:
      return False
    return True
  return False


def test_every_epljax_name_the_docs_quote_exists():
  """`epljax.progress.PEAK_TFLOPS` in a page, where the table is epljax.cost.PEAK_FLOPS, fails."""
  missing = []
  for path in PAGES:
    text = open(path).read()
    for name in sorted(set(re.findall(r"`(epljax(?:\.\w+)+)`", text))):
      if not _resolves(name):
        missing.append(f"{os.path.relpath(path, REPO)}: {name}")
  assert not missing, missing


def test_the_plan_printed_in_concepts_is_todays(capsys):
  """docs/concepts.md shows the quick start's plan as ``examples/quickstart.py --plan`` prints
  it now (the same on jax 0.10 and 0.12: the figures are the compiled step's)."""
  import runpy

  text = open(os.path.join(DOCS, "concepts.md")).read()
  m = re.search(r"<!-- plan of: examples/quickstart.py (?P<args>[^>]*?) -->\n```text\n"
                r"(?P<plan>.*?)\n```", text, re.S)
  assert m, "docs/concepts.md has no '<!-- plan of: examples/quickstart.py ... -->' block"
  module = runpy.run_path(os.path.join(REPO, "examples", "quickstart.py"))
  capsys.readouterr()
  module["main"](m.group("args").split())
  printed = capsys.readouterr().out
  plan = printed[:printed.index("\nIteration")].rstrip()
  assert m.group("plan") == plan, (
      "docs/concepts.md's plan is not what examples/quickstart.py prints today; paste this:\n"
      + plan)
