"""Tensor parallelism: one model's decoder layers split across ranks by its family's plan.

transformers ships, in each major family's config, a tensor-parallel plan
(``base_model_tp_plan``): which linear layers split by output features ("colwise": q, k, v,
gate, up) and which by input features ("rowwise": o, down), so that a layer needs two sums
across ranks (after the attention output and after the MLP) and nothing else. SpecServe
reads that plan and slices the weights itself, in place, on a model loaded whole: it runs
the model with its own attention and KV cache (``specdec.runner``), which see each rank's
share of the heads as if the model had that many, so nothing there changes. The sums are
forward hooks on the row-wise layers (``all_reduce``: any callable that sums a tensor in
place over the group), which keeps this module free of ``torch.distributed``: the caller
(:mod:`specdec.rank_group`) brings the group.

Embeddings, norms and the LM head stay whole on every rank: each rank's hidden states are
the same after every sum, so every rank computes the same logits and rank 0's are used.
That costs each rank the embedding and head memory (vLLM splits them by vocabulary; here
the plan's top-level entries for them are not used).

KV heads: with ``N`` ranks and ``H`` query heads, each rank holds ``H / N`` query heads. It
holds ``KV / N`` key/value heads where ``N`` divides ``KV``; where ``KV`` divides ``N``
(Llama 3 70B: 8 KV heads at TP = 16; Qwen 2.5 3B: 2 KV heads at TP = 4), each rank holds
the one KV head its query heads read, so each KV head lives on ``N / KV`` ranks (as vLLM
replicates them). Pure torch, no process group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# What the plan's styles mean here. A family whose plan names any other style (fused or
# packed projections that gather their outputs, experts, sequence parallelism) is refused.
COLWISE, ROWWISE = "colwise", "rowwise"
REPLICATED = ("replicated_with_grad_allreduce",)  # whole on every rank (Qwen 3's q/k norms)
STYLES = (COLWISE, ROWWISE, *REPLICATED)
# The key and value projections, by the names every planned family gives them: with fewer
# KV heads than ranks they are replicated by head, not split.
KV_PROJECTIONS = ("k_proj", "v_proj")


class TensorParallelError(ValueError):
    """A model that cannot be split this way, and why (raised before any weight moves)."""


@dataclass(frozen=True)
class ShardPlan:
    """How one model splits over ``world_size`` ranks (from :func:`shard_plan`)."""

    world_size: int  # ranks, N
    styles: dict[str, str]  # module pattern ("layers.*.self_attn.q_proj") -> style
    num_heads: int  # query heads of the whole model, H
    num_kv_heads: int  # key/value heads of the whole model, KV
    head_dim: int  # features per query, key and value head [features]

    @property
    def kv_replicas(self) -> int:
        """Ranks that hold each KV head: 1 where N divides KV, else N / KV."""
        return max(1, self.world_size // self.num_kv_heads)

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.world_size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.world_size)


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def shard_plan(config, world_size: int) -> ShardPlan:
    """The plan for ``config`` at ``world_size`` ranks, or :class:`TensorParallelError`
    with the reason: no plan in the family's config, a style this module does not apply,
    or head and feature counts that ``world_size`` does not split."""
    if world_size < 1:
        raise TensorParallelError(f"tensor_parallel_size must be >= 1, got {world_size}")
    text = _text_config(config)
    name = getattr(text, "model_type", type(text).__name__)
    styles = dict(getattr(text, "base_model_tp_plan", None) or {})
    if not styles:
        raise TensorParallelError(f"{name} has no tensor-parallel plan (base_model_tp_plan)")
    unknown = sorted({s for s in styles.values() if s not in STYLES})
    if unknown:
        raise TensorParallelError(
            f"{name}'s tensor-parallel plan uses {', '.join(unknown)}: only "
            f"{', '.join(STYLES)} layers are split here"
        )
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    plan = ShardPlan(world_size, styles, heads, kv_heads, head_dim)
    _check_divides(name, text, plan)
    named = {p.rsplit(".", 1)[-1] for p, s in styles.items() if s == COLWISE}
    if plan.kv_replicas > 1 and not set(KV_PROJECTIONS) <= named:
        raise TensorParallelError(
            f"{name}: {kv_heads} key/value heads on {world_size} ranks must be replicated, "
            f"which needs its plan to name {' and '.join(KV_PROJECTIONS)}"
        )
    return plan


def _check_divides(name: str, text, plan: ShardPlan) -> None:
    """Every split count is whole: query heads, KV heads (or their replicas), MLP width."""
    n = plan.world_size
    if plan.num_heads % n:
        raise TensorParallelError(
            f"{name}: {plan.num_heads} attention heads do not split over {n} ranks"
        )
    if plan.num_kv_heads % n and n % plan.num_kv_heads:
        raise TensorParallelError(
            f"{name}: {plan.num_kv_heads} key/value heads neither split over {n} ranks nor "
            f"replicate evenly onto them (one of the two counts must divide the other)"
        )
    width = getattr(text, "intermediate_size", None)
    if isinstance(width, int) and width % n:
        raise TensorParallelError(f"{name}: an MLP of {width} features does not split over {n}")


def _matches(pattern: str, name: str) -> bool:
    """Whether module ``name`` (inside the base model) fits a plan pattern ("*": one part)."""
    parts, names = pattern.split("."), name.split(".")
    if len(parts) != len(names):
        return False
    return all(p in ("*", n) for p, n in zip(parts, names, strict=True))


@dataclass(frozen=True)
class Slicing:
    """How a parameter of the whole model becomes a rank's: the ``index`` range along
    ``dim`` (rows of a column-wise layer, columns of a row-wise one), or zeros (a row-wise
    layer's bias off rank 0: the sum adds it once)."""

    dim: int
    index: slice
    zero: bool = False

    def take(self, tensor) -> torch.Tensor:
        """This rank's part of ``tensor`` (a tensor, or a safetensors slice: only that
        part is read from the file)."""
        part = tensor[self.index] if self.dim == 0 else tensor[:, self.index]
        return torch.zeros_like(part) if self.zero else part


def shard_model(
    model: torch.nn.Module,
    plan: ShardPlan,
    rank: int,
    all_reduce: Callable[[torch.Tensor], None],
) -> dict[str, Slicing]:
    """Keep rank ``rank``'s share of every planned layer of ``model``, in place (on the
    meta device too: then only the shapes change), and sum each row-wise layer's output
    over the group with ``all_reduce``. Returns how each split parameter was cut, by its
    name in ``model``. Call on every rank with the same model."""
    if not 0 <= rank < plan.world_size:
        raise TensorParallelError(f"rank {rank} of {plan.world_size}")
    # The plan names modules inside the decoder ("layers.*..."), which a composite model
    # (Gemma 3: vision and text) keeps deeper than its base model.
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    prefix = next(n for n, m in model.named_modules() if m is base)
    cuts: dict[str, Slicing] = {}
    for name, module in base.named_modules():
        style = next((s for p, s in plan.styles.items() if _matches(p, name)), None)
        if style not in (COLWISE, ROWWISE):
            continue
        if not isinstance(module, torch.nn.Linear):
            raise TensorParallelError(f"{name} is {type(module).__name__}, not a Linear")
        if style == COLWISE:
            rows = Slicing(0, _output_rows(name, module, plan, rank))
            own = {"weight": rows, "bias": rows}
        else:
            own = _split_inputs(module, plan, rank, all_reduce)
        full = f"{prefix}.{name}" if prefix else name
        for kind, cut in own.items():
            param = getattr(module, kind)
            if param is not None:
                part = cut.take(param.data).clone()  # (a copy: the whole tensor is freed)
                setattr(module, kind, torch.nn.Parameter(part, requires_grad=False))
                cuts[f"{full}.{kind}"] = cut
        module.out_features, module.in_features = module.weight.shape
    if not cuts:
        raise TensorParallelError(f"no module of {type(model).__name__} matches its plan")
    for module in base.modules():  # attention that repeats KV heads reads this ratio
        if hasattr(module, "num_key_value_groups"):
            module.num_key_value_groups = plan.local_heads // plan.local_kv_heads
    return cuts


def _output_rows(name: str, module: torch.nn.Linear, plan: ShardPlan, rank: int) -> slice:
    """The output features of ``rank`` in a column-wise layer: a key or value projection
    of fewer heads than ranks keeps the one head this rank's query heads read (head
    ``rank // kv_replicas``); any other layer splits evenly."""
    out, n = module.out_features, plan.world_size
    if plan.kv_replicas > 1 and name.rsplit(".", 1)[-1] in KV_PROJECTIONS:
        per_head = out // plan.num_kv_heads
        head = rank // plan.kv_replicas
        return slice(head * per_head, (head + 1) * per_head)
    if out % n:
        raise TensorParallelError(f"{name}: {out} output features do not split over {n} ranks")
    share = out // n
    return slice(rank * share, (rank + 1) * share)


def _split_inputs(
    module: torch.nn.Linear,
    plan: ShardPlan,
    rank: int,
    all_reduce: Callable[[torch.Tensor], None],
) -> dict[str, Slicing]:
    """The cuts of a row-wise layer (``rank``'s input features; the bias added once, on
    rank 0, to the sum), whose output is summed over the ranks from now on."""
    features, n = module.in_features, plan.world_size
    if features % n:
        raise TensorParallelError(f"{features} input features do not split over {n} ranks")
    share = features // n
    whole = slice(0, module.out_features)

    def summed(_module, _inputs, output: torch.Tensor) -> torch.Tensor:
        all_reduce(output)
        return output

    module.register_forward_hook(summed)
    return {
        "weight": Slicing(1, slice(rank * share, (rank + 1) * share)),
        "bias": Slicing(0, whole, zero=rank != 0),
    }


@dataclass(frozen=True)
class ModelShard:
    """A rank's place in its tensor-parallel group, as a runner needs it to load its share
    (:class:`specdec.rank_group.RankGroup.shard` makes one)."""

    world_size: int  # ranks, N
    rank: int  # this one's index, 0 .. N - 1
    all_reduce: Callable[[torch.Tensor], None]  # sums a tensor over the ranks, in place
    min_over_ranks: Callable[[int], int]  # the least of a count over the ranks
    barrier: Callable[[], None] | None = None  # waits for every rank (after loading)
