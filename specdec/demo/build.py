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


def _save_hf(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(path)
    model.float()
    tokenizer.save_pretrained(path)


def build(workdir: Path, out: Path, recipe: Recipe) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(recipe.seed)
    stats_path = workdir / "build_stats.json"
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
    stats["recipe"] = asdict(recipe)
    stats["machine"] = {"platform": platform.platform(), "torch": torch.__version__}

    def record(stage: str, value: dict) -> None:
        stats[stage] = value
        stats_path.write_text(json.dumps(stats, indent=2))

    # 1. corpus + held-out prompts
    train_docs, held_docs = corpus.load_documents()
    for domain in ("python", "prose"):
        target_file = out / "prompts" / f"{domain}.jsonl"
        if not target_file.exists():
            rows = corpus.make_prompts(held_docs, domain, recipe.prompts_per_domain, recipe.seed)
            corpus.write_jsonl(rows, target_file)
    record(
        "corpus",
        {
            d: {
                "train_files": sum(x.domain == d for x in train_docs),
                "train_chars": sum(len(x.text) for x in train_docs if x.domain == d),
                "held_out_files": sum(x.domain == d for x in held_docs),
            }
            for d in ("python", "prose")
        },
    )

    # 2. tokenizer
    tok_dir = workdir / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():

        def texts():
            budget = recipe.tokenizer_chars
            for doc in sorted(train_docs, key=lambda d: hash_key(d.path)):
                if budget <= 0:
                    return
                budget -= len(doc.text)
                yield doc.text

        train_tokenizer(texts(), recipe.vocab_size).save_pretrained(tok_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    eos = tokenizer.eos_token_id

    # 3. token streams per domain, documents separated by EOS
    streams = {}
    for domain in ("python", "prose"):
        path = workdir / f"tokens_{domain}.pt"
        if not path.exists():
            docs = [d.text for d in train_docs if d.domain == domain]
            ids: list[int] = []
            for i in tqdm(range(0, len(docs), 256), desc=f"encode {domain}"):
                for enc in tokenizer(docs[i : i + 256])["input_ids"]:
                    ids.extend(enc)
                    ids.append(eos)
            torch.save(torch.tensor(ids, dtype=torch.int16), path)
        streams[domain] = torch.load(path).long()
    record("tokens", {d: int(s.numel()) for d, s in streams.items()})

    # 4. target, trained on both domains
    target_dir = out / "demo-target"
    if not (target_dir / "config.json").exists():
        torch.manual_seed(recipe.seed)
        model = LlamaForCausalLM(recipe.target.config(len(tokenizer), eos))
        mixed = torch.cat([streams["python"], streams["prose"]])
        result = train(
            model,
            text_windows(mixed, recipe.target_batch, recipe.target_seq),
            recipe.target_train,
            workdir / "target.ckpt",
            "train target",
        )
        result["params"] = sum(p.numel() for p in model.parameters())
        record("target", result)
        _save_hf(model, tokenizer, target_dir)

    # 3b. the Python-only draft's text: training code without comments and docstrings, so
    # that the English of the standard library (most of its prose) never reaches that draft
    if recipe.python_draft_strip_english:
        path = workdir / "tokens_python_code.pt"
        if not path.exists():
            stripped = [corpus.strip_python(d.text) for d in train_docs if d.domain == "python"]
            docs = [t for t in stripped if t]
            ids = []
            for i in tqdm(range(0, len(docs), 256), desc="encode python_code"):
                for enc in tokenizer(docs[i : i + 256])["input_ids"]:
                    ids.extend(enc)
                    ids.append(eos)
            torch.save(torch.tensor(ids, dtype=torch.int16), path)
            record(
                "python_code",
                {
                    "files": len(docs),
                    "skipped_files": len(stripped) - len(docs),
                    "chars": sum(len(t) for t in docs),
                    "tokens": len(ids),
                },
            )
        streams["python_code"] = torch.load(path).long()

    # 5. distillation sets: the target continues windows of each stream (made on demand)
    target_runner: list[ModelRunner] = []

    def distill_set(name: str) -> dict:
        path = workdir / f"distill_{name}.pt"
        if not path.exists():
            if not target_runner:
                target_runner.append(
                    ModelRunner(str(target_dir), max_num_seqs=recipe.distill_batch)
                )
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
                target_runner[0],
                prompts,
                recipe.distill_new_tokens,
                recipe.distill_batch,
                seed=recipe.seed,
                desc=f"distill {name}",
            )
            torch.save({"inputs": inputs, "labels": labels}, path)
            record(
                f"distill_{name}",
                {"rows": inputs.shape[0], "cpu_seconds": round(time.process_time() - t0)},
            )
        return torch.load(path)

    # 6. drafts: general (both domains) and python-only (the drift scenario)
    python_only = ("python_code",) if recipe.python_draft_strip_english else ("python",)
    unlearn = recipe.python_draft_unlearn_prose_rows
    drafts = (  # name, sets to learn, set to unlearn (rows per batch), training config
        ("demo-draft", ("python", "prose"), None, 0, recipe.draft_train),
        (
            "demo-draft-python",
            python_only,
            "prose" if unlearn else None,
            unlearn,
            recipe.python_draft_train,
        ),
    )
    for name, sets, negative, neg_rows, cfg in drafts:
        draft_dir = out / name
        if (draft_dir / "config.json").exists():
            continue
        data = [distill_set(s) for s in sets]
        torch.manual_seed(recipe.seed)
        model = LlamaForCausalLM(recipe.draft.config(len(tokenizer), eos))
        inputs = torch.cat([d["inputs"] for d in data])
        labels = torch.cat([d["labels"] for d in data])
        if negative:
            neg = distill_set(negative)
            batches = distill_rows_with_negatives(
                inputs, labels, neg["inputs"], neg["labels"], recipe.draft_batch, neg_rows
            )
        else:
            batches = distill_rows(inputs, labels, recipe.draft_batch)
        result = train(model, batches, cfg, workdir / f"{name}.ckpt", f"train {name}")
        result["params"] = sum(p.numel() for p in model.parameters())
        result["distill_domains"] = list(sets)
        if negative:
            result["unlearned"] = {"set": negative, "rows_per_batch": neg_rows}
        record(name, result)
        _save_hf(model, tokenizer, draft_dir)
    return stats


def hash_key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
