"""The zoo's Llama: the model of ``examples/example_models/llama.py`` (layers under ``nn.scan``,
Flax logical axis names on every parameter, grouped-query attention, SwiGLU, rotary positions,
an untied head; ``Size`` and the presets of ``SIZES``), at the zoo's size ``SMALL``, with what
the zoo expects of it: Megatron's specs and the one-line annotation. The model code lives with
the examples (they run from a clone without tests/); change it there.
"""

from __future__ import annotations

from example_models.llama import (  # noqa: F401  (the zoo's and the benches' names)
    DENSE_INIT, LOGICAL_RULES, SIZES, SMALL, Attention, Layer, Llama, Projection, RMSNorm, Size,
    SwiGLU, fns, logical)

VOCAB, D_MODEL, HEADS, KV_HEADS, HEAD_DIM, MLP, LAYERS = (
    SMALL.vocab, SMALL.d_model, SMALL.heads, SMALL.kv_heads, SMALL.head_dim, SMALL.mlp,
    SMALL.layers)

MODEL = Llama()
init_fn, loss_fn = fns(SMALL)

# Megatron on the scanned parameters (leading layers axis never split).
MEGATRON = {
    r"params/embed/embedding": ("model", None),
    r"params/layers/attn/(query|key|value)/kernel": (None, None, "model", None),
    r"params/layers/attn/out/kernel": (None, "model", None, None),
    r"params/layers/mlp/wi_(gate|up)/kernel": (None, None, "model"),
    r"params/layers/mlp/wo/kernel": (None, "model", None),
    r"params/(layers/)?\w*norm/scale": (),
    r"params/head/kernel": (None, "model"),
}
ANNOTATE = r"Llama/(embed|layers/(attn|mlp)|head)"
