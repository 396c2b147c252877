"""``trainer.plan`` and ``python -m epljax.plan``.

``view.py``: the ``Plan`` a Trainer prints (mesh, task graphs, specs, bytes per device and
whether they fit, collectives per mesh axis and host crossings, predicted step time).
``cli.py``: ``python -m epljax.plan SCRIPT --topology h100:8x8 [ARGS]``, a training script
planned for a cluster it does not run on.
"""

from epljax.plan.view import (EVERY_STAGE, Leaf, Plan, StepCollective, html_plan,
                              leaf_bytes_per_device, render_text, search_rows,
                              tree_bytes_per_device)

__all__ = ["EVERY_STAGE", "Leaf", "Plan", "StepCollective", "html_plan",
           "leaf_bytes_per_device", "render_text", "search_rows", "tree_bytes_per_device"]
