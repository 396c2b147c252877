"""examples/notebook.ipynb runs top to bottom in a Jupyter kernel on 8 CPU devices, shows the
plan as HTML tables, and its committed outputs are today's; the progress bar never writes into
a printed line."""

from __future__ import annotations

import io
import json
import os
import re
import sys

import epljax as epl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "examples", "notebook.ipynb")


def _execute(tmp_path, monkeypatch):
  """The notebook, executed top to bottom in a fresh kernel."""
  import nbformat
  from nbclient import NotebookClient

  notebook = nbformat.read(NOTEBOOK, as_version=4)
  # The kernel runs this interpreter (a kernelspec of its own, first on JUPYTER_PATH, so no
  # user's or system's "python3" kernel is picked) and inherits this environment (XLA_FLAGS
  # with 8 devices, JAX_PLATFORMS=cpu); a fixed hash seed, so the printed plans are the same
  # from run to run.
  spec = tmp_path / "kernels" / "python3"
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "Python 3 (epljax tests)", "language": "python",
      "env": {"PYTHONHASHSEED": "0"}}))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
  client = NotebookClient(notebook, timeout=600, kernel_name="python3", record_timing=False,
                          resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
  client.execute()
  return notebook


def _bar_text(notebook, model_id: str) -> str | None:
  """A tqdm widget's last state as the text tqdm prints in a terminal (what GitHub, which does
  not run widgets, then shows instead of the bar's first state)."""
  import html

  state = notebook.metadata.get("widgets", {}).get(
      "application/vnd.jupyter.widget-state+json", {}).get("state", {})
  children = state.get(model_id, {}).get("state", {}).get("children", [])
  parts = [state.get(c.replace("IPY_MODEL_", ""), {}).get("state", {}) for c in children]
  if len(parts) != 3 or "max" not in parts[1]:
    return None
  done = int(10 * parts[1]["value"] / max(parts[1]["max"], 1))
  return html.unescape(f"{parts[0].get('value', '')}|{'█' * done}{' ' * (10 - done)}|"
                       f"{parts[2].get('value', '')}").replace("\u2007", " ")


def _kept(notebook):
  """The executed notebook as committed: without stderr (warnings name local paths) and
  execution counts, each bar's text its last state, with the jax version that made the
  outputs."""
  import jax

  for cell in notebook.cells:
    if cell.cell_type == "code":
      cell.outputs = [o for o in cell.outputs
                      if not (o.output_type == "stream" and o.name == "stderr")]
      cell.execution_count = None
      for o in cell.outputs:
        if "execution_count" in o:
          o.execution_count = None
        view = o.get("data", {}).get("application/vnd.jupyter.widget-view+json")
        text = view and _bar_text(notebook, view["model_id"])
        if text:
          o.data["text/plain"] = text
  notebook.metadata["epljax"] = {"outputs_made_with": f"jax {jax.__version__}"}
  return notebook


def _deterministic(notebook, mask_numbers: bool):
  """Per code cell, what must not change between runs of the same code: printed lines, plans
  (HTML) and results; a progress bar (a widget: its rates are timings) and image bytes count
  only as present. With ``mask_numbers`` (another jax version) numbers are masked and the
  plans' collectives tables left out: another XLA groups and combines collectives otherwise
  (jax 0.10's split step all-reduces its scalars over every device on their own)."""
  out = []
  for cell in notebook.cells:
    if cell.cell_type != "code":
      continue
    for o in cell.outputs:
      data = o.get("data", {})
      if o.output_type == "stream" and o.name == "stdout":
        text = o.text
      elif "application/vnd.jupyter.widget-view+json" in data:
        text = "<widget>"
      elif "image/png" in data:
        text = "<image>"
      elif "text/html" in data:
        text = data["text/html"]
      elif "text/plain" in data:
        text = data["text/plain"]
      else:
        continue
      if mask_numbers:   # another jax: its XLA may combine collectives otherwise
        text = re.sub(r"<h4>collectives per step.*?(?=<h4>|</div>)", "", text, flags=re.S)
        text = re.sub(r"\d+(\.\d+)?(e[+-]?\d+)?", "#", text)
      out.append(text)
  return out


def test_the_notebook_runs_and_its_saved_outputs_are_todays(tmp_path, monkeypatch):
  """The notebook runs without an error, shows the plans as HTML tables, a bar and plots, and
  the outputs committed in it (rendered on GitHub and in the site) are what it prints now:
  exactly on the jax version that made them, numbers aside on another. With
  EPLJAX_WRITE_NOTEBOOK=1 the test saves the new outputs into examples/notebook.ipynb."""
  import nbformat

  notebook = _kept(_execute(tmp_path, monkeypatch))
  outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
  errors = [o for o in outputs if o.output_type == "error"]
  assert not errors, errors
  html = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
  plans = [h for h in html if "epljax-plan" in h]
  assert len(plans) == 3 and all("<table>" in h for h in plans)
  assert "model=2" in plans[0] and "pipeline stages" in plans[1]
  assert "auto.auto_parallel" in plans[2]                       # the GPT's searched plan
  printed = "".join(o.text for o in outputs if o.output_type == "stream")
  assert "restored step 5" in printed and "uninterrupted" in printed
  assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs)
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) >= 4           # the plan's schedule, the picture, two loss plots

  if os.environ.get("EPLJAX_WRITE_NOTEBOOK"):
    nbformat.write(notebook, NOTEBOOK)
    return
  saved = nbformat.read(NOTEBOOK, as_version=4)
  made_with = saved.metadata.get("epljax", {}).get("outputs_made_with")
  assert made_with, ("examples/notebook.ipynb carries no outputs; save them with "
                     "EPLJAX_WRITE_NOTEBOOK=1 python -m pytest tests/test_notebook.py")
  same_jax = made_with == notebook.metadata["epljax"]["outputs_made_with"]
  assert _deterministic(saved, not same_jax) == _deterministic(notebook, not same_jax), (
      f"examples/notebook.ipynb's saved outputs ({made_with}) are not what it prints today; "
      "save them again with EPLJAX_WRITE_NOTEBOOK=1 python -m pytest tests/test_notebook.py")


def test_plan_html_is_the_text_plan_as_tables():
  import jax
  import optax

  from helpers import MLP, classification_batch, linen_fns
  epl.set_default_strategy(epl.replicate(1))
  init_fn, loss_fn = linen_fns(MLP())
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  trainer.init(jax.random.key(0), classification_batch(32))
  html, text = trainer.plan._repr_html_(), str(trainer.plan)
  for title, _blocks in trainer.plan.sections():
    assert title in text and f"<h4>{title}</h4>" in html.replace("&#x27;", "'")
  for leaf in trainer.plan.leaves:
    assert f"<code>{leaf.path}</code>" in html and leaf.path in text
  assert html.count("<table>") >= 5 and "<script" not in html


def test_printed_lines_never_carry_bar_text_in_a_log(monkeypatch):
  """In a log (a pipe, a file) a bar cannot redraw in place; each printed line stands alone."""
  log = io.StringIO()                 # stdout and the bar's stream merged, as a launcher's log
  monkeypatch.setattr(sys, "stdout", log)
  with epl.progress(total=5, file=log, mininterval=0) as bar:
    for step in range(5):
      bar.update({"loss": 1.0 / (step + 1)})
      bar.write(f"line {step}")
  lines = log.getvalue().split("\n")
  printed = [line for line in lines if "line " in line]
  assert printed == [f"line {i}" for i in range(5)], lines
  assert any("5/5" in line for line in lines)          # the bar was drawn
