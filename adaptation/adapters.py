"""Low-rank adapters (LoRA, the ``peft`` library) for drafts too large to ship whole.

A run on a draft with at least ``trainer.adapter_min_params`` parameters trains adapters
on every linear layer but the output head instead of every weight: the optimizer state is
small, and the swap ships the factors (:class:`specdec.low_rank.LowRankUpdate`), a few
megabytes, to replicas that serve the version it was trained on. The run also merges
them (:func:`specdec.low_rank.merged`, the replicas' own arithmetic) into the full state
dict, kept for rollbacks, exports and replicas that serve another version.

``peft`` is an optional dependency (``pip install 'specserve[adapters]'``), imported only
here and only when a run uses adapters.
"""

from __future__ import annotations

import torch

from specdec.low_rank import LowRankUpdate, merged


def with_adapters(model: torch.nn.Module, rank: int, alpha: float) -> torch.nn.Module:
    """``model`` with LoRA adapters on every ``nn.Linear`` but the output head; only the
    adapters train."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:  # (the error says how to get it)
        raise RuntimeError(
            "a run with adapters needs the peft library: pip install 'specserve[adapters]'"
        ) from exc
    head = model.get_output_embeddings()
    targets = sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not head
        }
    )
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets)
    return get_peft_model(model, config)


def adapter_update(
    model: torch.nn.Module, base_version: int, dtype: torch.dtype
) -> tuple[LowRankUpdate, dict[str, torch.Tensor]]:
    """The adapters of a :func:`with_adapters` model as a :class:`LowRankUpdate` over
    ``base_version``, and the full state dict they merge into (in ``dtype``, the base
    weights rounded to it first, as a replica holds them)."""
    from peft.tuners.lora import LoraLayer

    inner = model.get_base_model()
    factors, scale = {}, None
    for name, module in inner.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            a = module.lora_A["default"].weight.detach().float().clone()  # [rank, in]
            b = module.lora_B["default"].weight.detach().float().clone()  # [out, rank]
            factors[f"{name}.weight"] = (a, b)
            scale = float(module.scaling["default"])
    base = {
        k.replace(".base_layer", ""): v.detach().to(dtype)
        for k, v in inner.state_dict().items()
        if "lora_" not in k
    }
    full = dict(base)
    for name, (a, b) in factors.items():
        full[name] = merged(base[name], a, b, scale)
    return LowRankUpdate(base_version, factors, scale if scale is not None else 0.0), full
