"""Held-out models: what ``bench/estimate.py`` checks the plan search's estimates on, apart
from the zoo (``tests/models``) its estimates were first written against. Nothing in epljax
is tuned on them: a change to the estimate is checked on all of them and on the zoo alike.

- ``bert``: an encoder with one fused q/k/v kernel ``(C, 3C)``, post-LayerNorm, token, position
  and segment embeddings, a masked-language head tied to the token table.
- ``convnext``: depthwise 7x7 convolutions (``feature_group_count`` = channels), LayerNorm, an
  inverted-bottleneck MLP with layer scale, a strided-convolution downsampling between stages.
- ``mixer``: MLP-Mixer, patches embedded by a Dense layer, token-mixing MLPs over the
  transposed patches, channel-mixing MLPs.
- ``moe``: a decoder whose feed-forward layers are ``epljax.nn.MoE`` (top-2 routing with
  capacity), its load-balancing loss added to the language-model loss.
- ``t5``: an encoder-decoder with T5's heads-shaped ``DenseGeneral`` kernels, RMSNorm,
  cross-attention from the decoder to the encoder's output and a separate output head.

Each is a ``HeldOut``; ``HELDOUT`` maps names to them. Sizes are small (8 CPU devices compile
each step in seconds); the structure is the real family's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from heldout import bert, convnext, mixer, moe, t5


@dataclasses.dataclass(frozen=True)
class HeldOut:
  name: str
  init_fn: Callable[[Any, dict], Any]    # (rng, batch) -> variables
  loss_fn: Callable[[Any, dict], Any]    # (variables, batch) -> mean loss
  make_batch: Callable[[int], dict]      # rows -> deterministic numpy batch


HELDOUT: dict[str, HeldOut] = {
    m.NAME: HeldOut(m.NAME, m.init_fn, m.loss_fn, m.make_batch)
    for m in (bert, convnext, mixer, moe, t5)
}
