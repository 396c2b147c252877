"""Pipeline parallelism: stages cut from the captured program, GPipe and 1F1B tick tables (also
interleaved over virtual stages), and the ``shard_map`` loop that runs them in one SPMD program.

- ``partition.py``: the traced loss -> one ``ClosedJaxpr`` per stage;
- ``schedules.py``: ``PreferForward`` (GPipe) and ``PreferBackward`` (1F1B) as tick tables,
  interleaved with ``pipeline.num_virtual_stages > 1``;
- ``packing.py``: one ``Layout`` for every buffer the loop carries (parameters, activations,
  residuals, model state): flat per-dtype buffers, or whole arrays in slots;
- ``storage.py``: the parameter store (``ParamStore``): the stored leaves (the user's tree)
  <-> the loop's parameter buffers (tied leaves: copies, summed), moved in flat pieces by one
  ``all_to_all`` per dtype, or whole into slots by ``slots.py`` (tensor-parallel stages), which
  also keeps the model state, one row per stage;
- ``derived.py``: the residuals that are functions of the parameters alone (recomputed by
  the backward, not stashed);
- ``roll.py``: a stage's repeated layers as one ``lax.scan`` over stacked weights;
- ``stats.py``: batch statistics averaged over pipeline replicas (BatchNorm with several);
- ``runtime.py``: the loop over ticks (``jax.vjp`` per micro batch, ``ppermute`` between stages);
- ``cost.py``: what the loop computes per device (each branch's FLOPs times its busy slots)
  and its bubble, for the cost model (``epljax.cost``);
- ``builder.py``: the plan (``Pipeline``, immutable, built before anything compiles) and what
  ``epl.Trainer`` calls; ``describe.py``: the pipeline's lines in the plan, read from it;
  ``render.py``: the schedule as a picture.
"""

from epljax.pipeline.builder import Pipeline, PipelineWarning, plan_pipeline
from epljax.pipeline.render import render_schedule
from epljax.pipeline.schedules import Schedule, make_schedule

__all__ = ["Pipeline", "PipelineWarning", "Schedule", "make_schedule", "plan_pipeline",
           "render_schedule"]
