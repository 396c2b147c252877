"""The first section of ``print(trainer.plan)``: the verdict, in about a dozen lines.

Whether the compiled step fits (bytes per device against the limit), the mesh, batch and
features, the predicted step with its MFU and tokens per second per device, what crosses hosts
each step, and, when it does not fit, the cheapest config changes that would
(``epljax.plan.changes``).
"""

from __future__ import annotations

from epljax.errors import size


def verdict(plan) -> tuple[str, list[str]]:
  """The first section: what most readers came for, in a dozen lines."""
  per_device = size(plan.bytes_per_device)
  if plan.memory_limit is None:
    title = f"epljax plan: {per_device} per device (no memory limit known)"
  else:
    title = (f"epljax plan: {'fits' if plan.fits else 'DOES NOT FIT'}, {per_device} per "
             f"device of {size(plan.memory_limit)}")
  axes = " x ".join(f"{n}={s}" for n, s in plan.mesh.shape.items())
  first = next(iter(plan.mesh.devices.flat))
  hosts = len({d.process_index for d in plan.mesh.devices.flat})
  lines = [
      f"mesh      {axes} over {plan.mesh.size} {first.platform} devices"
      + (f" in {hosts} hosts" if hosts > 1 else ""),
      f"replicas  {plan.num_replicas}    stages {plan.num_stages}    "
      f"micro batches {plan.num_micro_batch}    schedule {plan.schedule}",
      f"batch     {plan.global_rows} rows per step = {plan.num_replicas} replicas x "
      f"{plan.micro_batch_per_replica} rows x {plan.num_micro_batch} micro batches, "
      f"split over ({', '.join(plan.batch_axes)})",
      *[f"feature   {f}" for f in plan.features]]
  cost = plan.cost
  if cost is not None:
    ms = lambda t: f"{t:.3g} s" if t >= 1 else f"{t * 1e3:.3g} ms"  # noqa: E731
    lines.append(f"step      {ms(cost.step_s)} predicted on {plan.chip.name}"
                 + (" (nominal figures)" if plan.chip.name == "cpu" else "")
                 + f": compute {ms(cost.compute_s)}, communication {ms(cost.exposed_s)} "
                 f"not hidden" + (f"; MFU {plan.mfu:.1%}" if plan.mfu is not None else ""))
    tokens = plan.tokens_per_s
    if tokens:
      lines.append(f"throughput  {_si(tokens)} tokens/s per device ({plan.tokens_per_step} "
                   "tokens per step)")
  elif plan.chip_note:
    lines.append(f"step      {plan.chip_note}")
  lines.append(_hosts_line(plan, hosts))
  if not plan.fits:
    found = plan.suggestions()
    lines += ([f"change    {c.line(plan.memory_limit)}" for c in found.changes]
              or ([f"change    {found.note}"] if found.note else []))
  return title, lines


def _hosts_line(plan, hosts: int) -> str:
  if hosts == 1:
    return "hosts     1: no collective crosses hosts"
  across: dict[tuple[str, str], int] = {}
  for c in plan.collectives:
    if c.crosses_hosts:
      across[(c.kind, c.axes)] = across.get((c.kind, c.axes), 0) + c.bytes
  if not across:
    return f"hosts     {hosts}: no collective crosses hosts"
  parts = [f"{k} over {a} {size(b)}" for (k, a), b in
           sorted(across.items(), key=lambda kv: -kv[1])]
  return f"hosts     {hosts}, crossed each step by " + ", ".join(parts)


def _si(x: float) -> str:
  for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if x >= scale:
      return f"{x / scale:.3g}{unit}"
  return f"{x:.3g}"
