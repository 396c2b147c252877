"""examples/notebook.ipynb runs top to bottom in a Jupyter kernel on 8 CPU devices, shows the
plan as HTML tables, and the progress bar never writes into a printed line."""

from __future__ import annotations

import io
import json
import os
import sys

import epljax as epl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "examples", "notebook.ipynb")


def test_the_notebook_runs_and_shows_the_plan_as_tables(tmp_path, monkeypatch):
  import nbformat
  from nbclient import NotebookClient

  notebook = nbformat.read(NOTEBOOK, as_version=4)
  # The kernel runs this interpreter (a kernelspec of its own, first on JUPYTER_PATH, so no
  # user's or system's "python3" kernel is picked) and inherits this environment (XLA_FLAGS
  # with 8 devices, JAX_PLATFORMS=cpu).
  spec = tmp_path / "kernels" / "python3"
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "Python 3 (epljax tests)", "language": "python"}))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
  client = NotebookClient(notebook, timeout=300, kernel_name="python3",
                          resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
  client.execute()
  outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
  errors = [o for o in outputs if o.output_type == "error"]
  assert not errors, errors
  html = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
  plans = [h for h in html if "epljax-plan" in h]
  assert len(plans) == 2 and all("<table>" in h for h in plans)
  assert "model=2" in plans[0] and "pipeline stages" in plans[1]
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) >= 4           # the plan's schedule, the picture, two loss plots


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
