"""Loading one rank's share of a checkpoint, without the whole model in memory.

Loaded whole and then cut (:func:`specdec.tensor_parallel.shard_model` on a real model),
every rank of a 70B target at TP = 4 would first hold all 141 GB in host memory: 564 GB on
one node before a byte reached a GPU. So a rank builds the model with its parameters on
the meta device (shapes only; buffers such as rotary frequencies are real, computed from
the config as usual), cuts the shapes to its share, and reads from the checkpoint's
safetensors files only the rows or columns of each tensor that it keeps
(``safe_open(...).get_slice``), straight to its device.

This reads checkpoints whose tensor names are the model's parameter names (what
``save_pretrained`` writes for the families with a tensor-parallel plan). Where they are
not (a family transformers renames on load, a checkpoint without safetensors), it returns
None and the caller loads the model whole and cuts it, as before.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from accelerate import init_empty_weights
from huggingface_hub import snapshot_download
from safetensors import safe_open
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from specdec.tensor_parallel import ModelShard, ShardPlan, Slicing, shard_model

logger = logging.getLogger("specserve.tensor_parallel")


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a local checkpoint (its index's, or the single file)."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / n for n in names]
    single = root / "model.safetensors"
    return [single] if single.is_file() else []


def _local(model: str) -> Path:
    """A local directory as it is; a hub id as its snapshot's directory (the JSON files and
    safetensors fetched, or found in the cache: the whole model's files, read by parts)."""
    if Path(model).is_dir():
        return Path(model)
    try:
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as exc:  # (offline without a cache, a gated repo without a token)
        logger.warning("%s: no snapshot to read by parts (%r)", model, exc)
        return Path(model)


def load_shard(
    model_dir: str,
    config,
    plan: ShardPlan,
    shard: ModelShard,
    dtype: torch.dtype,
    device: torch.device,
) -> PreTrainedModel | None:
    """Rank ``shard.rank``'s share of the checkpoint in ``model_dir`` (a local directory
    or a hub id) on ``device``, its sums through ``shard.all_reduce``, with SDPA attention
    (eager where the family has none, as whole models load); or None where the checkpoint
    cannot be read by parts (module docstring)."""
    root = _local(model_dir)
    files = checkpoint_files(root)
    if not files:
        logger.info(
            "%s: no safetensors to read by parts: loading it whole, then cutting", model_dir
        )
        return None
    with init_empty_weights(include_buffers=False):
        try:
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation="sdpa"
            )
        except ValueError:  # (Gemma 2: SDPA cannot soft-cap its scores)
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation="eager"
            )
    cuts = shard_model(model, plan, shard.rank, shard.all_reduce)
    params = dict(model.named_parameters())  # (a tied head appears once, as its source)
    loaded = _read(files, model, params, cuts, dtype, device)
    missing = sorted(set(params) - loaded - _tied_head(model, config))
    if missing:
        logger.info(
            "%s: %d parameters not found by name in its safetensors (e.g. %s): loading it "
            "whole, then cutting",
            model_dir,
            len(missing),
            missing[0],
        )
        return None
    model.tie_weights()  # a tied head takes the embedding just read
    if (root / "generation_config.json").is_file():  # its EOS ids, as loaded whole
        model.generation_config = GenerationConfig.from_pretrained(root)
    return model.to(device).eval()  # (the buffers, computed on the host at build)


def _read(
    files: list[Path],
    model: torch.nn.Module,
    params: dict[str, torch.nn.Parameter],
    cuts: dict[str, Slicing],
    dtype: torch.dtype,
    device: torch.device,
) -> set[str]:
    """Each parameter's part from the files, onto ``device``; returns the names read."""
    loaded = set()
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
                if key not in params:
                    continue
                cut = cuts.get(key)
                tensor = cut.take(f.get_slice(key)) if cut else f.get_tensor(key)
                value = tensor.to(device=device, dtype=dtype)
                if value.shape != params[key].shape:
                    raise ValueError(f"{key}: {tuple(value.shape)} for {params[key].shape}")
                module, _, leaf = key.rpartition(".")
                setattr(model.get_submodule(module), leaf, torch.nn.Parameter(value, False))
                loaded.add(key)
    return loaded


def _tied_head(model: PreTrainedModel, config) -> set[str]:
    """The LM head's parameter name where the config ties it to the input embedding (the
    checkpoint then holds the embedding alone; :meth:`tie_weights` shares it)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    head = model.get_output_embeddings()
    if head is None or not getattr(text, "tie_word_embeddings", False):
        return set()
    return {n for n, p in model.named_parameters(remove_duplicate=False) if p is head.weight}
