"""Losses that stay cheap when the classes are split over devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def softmax_cross_entropy_with_integer_labels(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """``optax.softmax_cross_entropy_with_integer_labels``, computed without a gather.

  Same numbers; the label's logit is picked with a comparison against the class index instead
  of ``take_along_axis``. With the classes split over devices (EPL's split classifier) the
  gather's gradient makes GSPMD move a logits-sized tensor between devices, while this form only
  reduces per-row sums: 773 KiB of collectives a step instead of 13.3 MB (a 12.5 MB all-to-all
  of logits among them) for 256 rows x 100k classes on 8 devices (bench/comm.py).
  """
  classes = jnp.arange(logits.shape[-1], dtype=labels.dtype)
  label_logit = jnp.sum(jnp.where(classes == labels[..., None], logits, 0), axis=-1)
  return jax.nn.logsumexp(logits, axis=-1) - label_logit
