"""Multi-process jobs: ``python -m epljax.launch`` and the worker's side of ``epl.init``.

    python -m epljax.launch --num_workers 2 --gpu_per_worker 4 train.py --steps 100

- ``cli``: EPL's launcher flags -> ``jobs.Job``;
- ``jobs``: the workers to start on this host (argv, coordinator, devices), pure functions;
- ``supervisor``: starts them, prefixes and logs their output, stops all when one fails;
- ``logs``: log files kept across runs (rotated), library noise left out of the console;
- ``runtime``: inside a worker, ``epl.init`` -> ``jax.distributed.initialize`` (once);
- ``worker``: inside a running worker: step heartbeats, ``stop_requested``, failing fast;
- ``run_script``: runs a ``.py`` SCRIPT as ``__main__`` (exits at once on a failure; warns
  when a script of a several-worker job starts JAX without ``epl.init()``).

JAX's own multi-controller runtime connects the workers (``jax.distributed``, gloo collectives
on CPU, NCCL on GPU); the launcher only starts processes with the right environment.
"""

from epljax.launch.worker import stop_requested

__all__ = ["stop_requested"]
