"""Which attention mask each decoder layer needs, from a model's config.

The runner hands the model its own 4-D masks (ragged rows, rolled-back slots), and
transformers uses a 4-D mask *as given*: it no longer adds a layer's sliding window. So
the runner must build the window into the mask itself, per layer type, or sliding-window
models (Mistral, Qwen 2 with ``use_sliding_window``, Gemma 2/3, Phi-3) silently attend to
the whole context. This module reads the layer types from the config and builds the
masks; :func:`attention_layout` refuses layer types it does not know how to mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FULL = "full_attention"
SLIDING = "sliding_attention"


class UnsupportedModelError(ValueError):
    """A checkpoint SpecServe cannot serve exactly; the message says why."""


@dataclass(frozen=True)
class AttentionLayout:
    """The mask kinds a decoder needs.

    ``keyed``: the model takes ``{layer_type: mask}`` (transformers' models that declare
    ``layer_types`` build such a mapping themselves and accept a prepared one); otherwise
    one mask serves every layer (Mistral and Phi-3: every layer slides, or none does).
    """

    num_layers: int
    layer_types: tuple[str, ...]  # one per decoder layer: FULL or SLIDING
    sliding_window: int | None  # keys a sliding layer sees, the query's own included
    keyed: bool

    @property
    def has_sliding(self) -> bool:
        return SLIDING in self.layer_types


def decoder_config(config):
    """The decoder's config: composite configs (Gemma 3 >= 4B, multimodal checkpoints)
    keep it under ``text_config``; ``get_text_config`` returns the config itself else."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def attention_layout(config) -> AttentionLayout:
    """Read layer types and window from a transformers config (composite or not)."""
    text = decoder_config(config)
    num_layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(num_layers, int) or num_layers < 1:
        raise UnsupportedModelError(
            f"{type(config).__name__} names no decoder layer count (num_hidden_layers)"
        )
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if types is not None:
        types = tuple(types)
        if len(types) != num_layers:
            raise UnsupportedModelError(
                f"layer_types lists {len(types)} layers for {num_layers} decoder layers"
            )
        unknown = sorted(set(types) - {FULL, SLIDING})
        if unknown:
            raise UnsupportedModelError(
                f"layer types {unknown} are not supported (only {FULL} and {SLIDING}): "
                "the runner cannot build their attention masks"
            )
        if SLIDING in types and not (isinstance(window, int) and window > 0):
            raise UnsupportedModelError("sliding layers without a positive sliding_window")
        return AttentionLayout(num_layers, types, window if SLIDING in types else None, True)
    if isinstance(window, int) and window > 0:  # Mistral, Phi-3: one window for all layers
        return AttentionLayout(num_layers, (SLIDING,) * num_layers, window, False)
    return AttentionLayout(num_layers, (FULL,) * num_layers, None, False)


def build_masks(
    layout: AttentionLayout,
    query_positions: torch.Tensor,
    kv_len: int,
    additive_dtype: torch.dtype | None = None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Masks for queries at ``query_positions`` over cache positions ``[0, kv_len)``.

    query_positions: [batch | 1, n] absolute positions (on the model's device).
    Returns ``[batch | 1, 1, n, kv_len]`` per layer type: True (or 0.0 with
    ``additive_dtype``, for eager attention, which adds the mask to its scores) where the
    query may attend: keys at or before it, and for sliding layers fewer than
    ``sliding_window`` positions back (transformers' convention: ``kv > q - window``).
    """
    kv = torch.arange(kv_len, device=query_positions.device)[None, None, :]  # [1, 1, kv]
    q = query_positions[:, :, None]  # [b, n, 1]
    causal = kv <= q  # [b, n, kv]
    masks: dict[str, torch.Tensor] = {}
    if FULL in layout.layer_types:
        masks[FULL] = causal
    if layout.has_sliding:
        masks[SLIDING] = causal & (kv > q - layout.sliding_window)
    for name, m in masks.items():
        m = m[:, None]  # [b, 1, n, kv]
        if additive_dtype is not None:
            zero = torch.zeros((), dtype=additive_dtype, device=m.device)
            low = torch.full(
                (), torch.finfo(additive_dtype).min, dtype=additive_dtype, device=m.device
            )
            m = torch.where(m, zero, low)
        masks[name] = m
    return masks if layout.keyed else masks[layout.layer_types[0]]


def exact_position_limit(config) -> int | None:
    """The longest sequence the runner reproduces exactly, where RoPE says so (else None).

    LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini) picks its frequencies from the longest
    position in the whole forward pass: once a sequence passes the pretraining length,
    every position switches to the long factors at once, and transformers' ``generate``
    recomputes the whole cache then. A KV cache that keeps its keys (and a ragged batch
    whose longest row would switch the others') cannot follow, but below that length the
    model is plain RoPE: serve up to there. (Dynamic NTK scaling changes only past
    ``max_position_embeddings``, which already bounds the context.)
    """
    params = getattr(decoder_config(config), "rope_parameters", None) or {}
    per_type = params and all(isinstance(v, dict) for v in params.values())
    entries = list(params.values()) if per_type else [params]
    limits = [
        p["original_max_position_embeddings"]
        for p in entries
        if p.get("rope_type") == "longrope" and p.get("original_max_position_embeddings")
    ]
    return min(limits) if limits else None
