"""The demo-pair recipe, stage by stage; each stage skips itself when its output exists.

Stages: corpus -> tokenizer -> encode (both domains, and the Python code stripped of its
English for demo-draft-python) -> target -> distill -> drafts. Outputs go to the
work directory (checkpoints, token streams, distillation sets) and to ``models/``
(Hugging Face directories in bf16, loadable with ``from_pretrained``).
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from specdec.demo import corpus
from specdec.demo.distill import generate_distillation_set
from specdec.demo.tokenizer import train_tokenizer
from specdec.demo.train import (
    TrainConfig,
    distill_rows,
    distill_rows_with_negatives,
    text_windows,
    train,
)
from specdec.runner import ModelRunner


@dataclass
class ModelShape:
    layers: int
    hidden: int
    heads: int
    intermediate: int

    def config(self, vocab: int, eos: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.heads,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            bos_token_id=eos,
            eos_token_id=eos,
            pad_token_id=eos,
        )


@dataclass
class Recipe:
    """Every knob of the build, recorded next to the models it produced."""

    seed: int = 0
    vocab_size: int = 4096
    tokenizer_chars: int = 8_000_000  # characters of training text the BPE sees
    target: ModelShape = field(default_factory=lambda: ModelShape(10, 256, 4, 704))
    draft: ModelShape = field(default_factory=lambda: ModelShape(1, 128, 2, 384))
    target_train: TrainConfig = field(
        default_factory=lambda: TrainConfig(steps=1100, lr=2e-3, warmup=100, cpu_budget_s=5400)
    )
    target_batch: int = 16
    target_seq: int = 256
    distill_rows_per_domain: int = 3072
    distill_prompt_len: int = 32
    distill_new_tokens: int = 96
    distill_batch: int = 128
    draft_train: TrainConfig = field(
        default_factory=lambda: TrainConfig(steps=1500, lr=3e-3, warmup=100, cpu_budget_s=1200)
    )
    draft_batch: int = 32
    prompts_per_domain: int = 300
    # demo-draft-python, the drift scenario's draft, must not know prose. It is distilled on
    # code with its English (comments, docstrings) stripped, and, because the demo target's
    # prose is so repetitive that any draft able to copy agrees with it, each of its batches
    # also holds this many rows of the prose set whose target labels it unlearns (an
    # unlikelihood loss, weight ``python_draft_train.unlikelihood_weight``); 0 turns it off.
    python_draft_strip_english: bool = True
    python_draft_distill_rows: int = 3072
    python_draft_unlearn_prose_rows: int = 8
    python_draft_train: TrainConfig = field(
        default_factory=lambda: TrainConfig(
            steps=1500,
            lr=3e-3,
            warmup=100,
            cpu_budget_s=1800,
            bf16_autocast=False,
            unlikelihood_weight=0.1,
        )
    )


# distillation windows are drawn with seed + this offset, one stream each
DISTILL_SEED_OFFSET = {"python": 1, "prose": 2, "python_code": 3}
DOMAINS = ("python", "prose")  # the two domains of the corpus, in the order built


def _save_hf(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(path)
    model.float()
    tokenizer.save_pretrained(path)


@dataclass
class _Build:
    """One build's state, handed from stage to stage: where it writes, its recipe, and the
    stats it records as it goes (rewritten after every stage, so an interrupted build
    still says what it did)."""

    workdir: Path  # checkpoints, token streams, distillation sets
    out: Path  # models/: the Hugging Face directories and the held-out prompts
    recipe: Recipe
    stats: dict
    target_runner: ModelRunner | None = None  # loaded once a distillation set is made

    @property
    def stats_path(self) -> Path:
        return self.workdir / "build_stats.json"

    def record(self, stage: str, value: dict) -> None:
        self.stats[stage] = value
        self.stats_path.write_text(json.dumps(self.stats, indent=2))


def build(workdir: Path, out: Path, recipe: Recipe) -> dict:
    """Run every stage whose output is missing; returns the build's stats."""
    workdir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(recipe.seed)
    stats_path = workdir / "build_stats.json"
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
    stats["recipe"] = asdict(recipe)
    stats["machine"] = {"platform": platform.platform(), "torch": torch.__version__}
    b = _Build(workdir, out, recipe, stats)
    train_docs = _corpus(b)
    tokenizer = _tokenizer(b, train_docs)
    streams = _token_streams(b, tokenizer, train_docs)
    _train_target(b, tokenizer, streams)
    if recipe.python_draft_strip_english:
        streams["python_code"] = _python_code_stream(b, tokenizer, train_docs)
    for name, sets, negative, neg_rows, cfg in _drafts(recipe):
        if not (out / name / "config.json").exists():
            _train_draft(b, tokenizer, streams, name, sets, (negative, neg_rows), cfg)
    return b.stats


def _corpus(b: _Build) -> list:
    """Stage 1: the training documents; writes the held-out prompts of each domain."""
    train_docs, held_docs = corpus.load_documents()
    for domain in DOMAINS:
        target_file = b.out / "prompts" / f"{domain}.jsonl"
        if not target_file.exists():
            rows = corpus.make_prompts(
                held_docs, domain, b.recipe.prompts_per_domain, b.recipe.seed
            )
            corpus.write_jsonl(rows, target_file)
    b.record(
        "corpus",
        {
            d: {
                "train_files": sum(x.domain == d for x in train_docs),
                "train_chars": sum(len(x.text) for x in train_docs if x.domain == d),
                "held_out_files": sum(x.domain == d for x in held_docs),
            }
            for d in DOMAINS
        },
    )
    return train_docs


def _tokenizer(b: _Build, train_docs: list) -> PreTrainedTokenizerBase:
    """Stage 2: a byte-level BPE trained on the first ``tokenizer_chars`` characters of
    the training documents, in a fixed (hashed) order."""
    tok_dir = b.workdir / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():

        def texts():
            budget = b.recipe.tokenizer_chars
            for doc in sorted(train_docs, key=lambda d: hash_key(d.path)):
                if budget <= 0:
                    return
                budget -= len(doc.text)
                yield doc.text

        train_tokenizer(texts(), b.recipe.vocab_size).save_pretrained(tok_dir)
    return AutoTokenizer.from_pretrained(tok_dir)


def _encode(tokenizer: PreTrainedTokenizerBase, docs: list[str], desc: str) -> list[int]:
    """Documents as one token stream, each followed by EOS."""
    ids: list[int] = []
    for i in tqdm(range(0, len(docs), 256), desc=desc):
        for enc in tokenizer(docs[i : i + 256])["input_ids"]:
            ids.extend(enc)
            ids.append(tokenizer.eos_token_id)
    return ids


def _token_streams(b: _Build, tokenizer, train_docs: list) -> dict[str, torch.Tensor]:
    """Stage 3: each domain's training text as a token stream (int16 on disk)."""
    streams = {}
    for domain in DOMAINS:
        path = b.workdir / f"tokens_{domain}.pt"
        if not path.exists():
            docs = [d.text for d in train_docs if d.domain == domain]
            ids = _encode(tokenizer, docs, f"encode {domain}")
            torch.save(torch.tensor(ids, dtype=torch.int16), path)
        streams[domain] = torch.load(path).long()
    b.record("tokens", {d: int(s.numel()) for d, s in streams.items()})
    return streams


def _train_target(b: _Build, tokenizer, streams: dict[str, torch.Tensor]) -> None:
    """Stage 4: the target, trained on both domains (skipped once saved)."""
    target_dir = b.out / "demo-target"
    if (target_dir / "config.json").exists():
        return
    recipe = b.recipe
    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM(recipe.target.config(len(tokenizer), tokenizer.eos_token_id))
    mixed = torch.cat([streams["python"], streams["prose"]])
    result = train(
        model,
        text_windows(mixed, recipe.target_batch, recipe.target_seq),
        recipe.target_train,
        b.workdir / "target.ckpt",
        "train target",
    )
    result["params"] = sum(p.numel() for p in model.parameters())
    b.record("target", result)
    _save_hf(model, tokenizer, target_dir)


def _python_code_stream(b: _Build, tokenizer, train_docs: list) -> torch.Tensor:
    """Stage 3b: the Python-only draft's text, the training code without comments and
    docstrings, so that the English of the standard library (most of its prose) never
    reaches that draft."""
    path = b.workdir / "tokens_python_code.pt"
    if not path.exists():
        stripped = [corpus.strip_python(d.text) for d in train_docs if d.domain == "python"]
        docs = [t for t in stripped if t]
        ids = _encode(tokenizer, docs, "encode python_code")
        torch.save(torch.tensor(ids, dtype=torch.int16), path)
        b.record(
            "python_code",
            {
                "files": len(docs),
                "skipped_files": len(stripped) - len(docs),
                "chars": sum(len(t) for t in docs),
                "tokens": len(ids),
            },
        )
    return torch.load(path).long()


def _distill_set(b: _Build, streams: dict[str, torch.Tensor], name: str) -> dict:
    """Stage 5 (on demand): the target's greedy continuations of random windows of one
    stream, ``{"inputs", "labels"}``; the target is loaded the first time one is made."""
    recipe = b.recipe
    path = b.workdir / f"distill_{name}.pt"
    if not path.exists():
        if b.target_runner is None:
            target_dir = str(b.out / "demo-target")
            b.target_runner = ModelRunner(target_dir, max_num_seqs=recipe.distill_batch)
        rows = recipe.distill_rows_per_domain
        if name == "python_code":
            rows = recipe.python_draft_distill_rows
        gen = torch.Generator().manual_seed(recipe.seed + DISTILL_SEED_OFFSET[name])
        stream = streams[name]
        starts = torch.randint(
            0, stream.numel() - recipe.distill_prompt_len, (rows,), generator=gen
        )
        prompts = stream[starts[:, None] + torch.arange(recipe.distill_prompt_len)[None]]
        t0 = time.process_time()
        inputs, labels = generate_distillation_set(
            b.target_runner,
            prompts,
            recipe.distill_new_tokens,
            recipe.distill_batch,
            seed=recipe.seed,
            desc=f"distill {name}",
        )
        torch.save({"inputs": inputs, "labels": labels}, path)
        b.record(
            f"distill_{name}",
            {"rows": inputs.shape[0], "cpu_seconds": round(time.process_time() - t0)},
        )
    return torch.load(path)


def _drafts(recipe: Recipe) -> tuple:
    """Stage 6's drafts: (name, sets to learn, set to unlearn, its rows per batch, training
    config) for the general draft (both domains) and the Python-only one (the drift
    scenario's)."""
    python_only = ("python_code",) if recipe.python_draft_strip_english else ("python",)
    unlearn = recipe.python_draft_unlearn_prose_rows
    return (
        ("demo-draft", DOMAINS, None, 0, recipe.draft_train),
        (
            "demo-draft-python",
            python_only,
            "prose" if unlearn else None,
            unlearn,
            recipe.python_draft_train,
        ),
    )


def _train_draft(
    b: _Build,
    tokenizer,
    streams: dict[str, torch.Tensor],
    name: str,
    sets: tuple[str, ...],
    unlearn: tuple[str | None, int],
    cfg: TrainConfig,
) -> None:
    """Stage 6: one draft distilled from the target's continuations of ``sets``, and
    taught to unlearn ``unlearn`` (a set and its rows per batch) where one is named."""
    recipe = b.recipe
    data = [_distill_set(b, streams, s) for s in sets]
    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM(recipe.draft.config(len(tokenizer), tokenizer.eos_token_id))
    inputs = torch.cat([d["inputs"] for d in data])
    labels = torch.cat([d["labels"] for d in data])
    negative, neg_rows = unlearn
    if negative:
        neg = _distill_set(b, streams, negative)
        batches = distill_rows_with_negatives(
            inputs, labels, neg["inputs"], neg["labels"], recipe.draft_batch, neg_rows
        )
    else:
        batches = distill_rows(inputs, labels, recipe.draft_batch)
    result = train(model, batches, cfg, b.workdir / f"{name}.ckpt", f"train {name}")
    result["params"] = sum(p.numel() for p in model.parameters())
    result["distill_domains"] = list(sets)
    if negative:
        result["unlearned"] = {"set": negative, "rows_per_batch": neg_rows}
    b.record(name, result)
    _save_hf(model, tokenizer, b.out / name)


def hash_key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
