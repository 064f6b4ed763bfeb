"""The demo-pair recipe, stage by stage; each stage skips itself when its output exists.

Stages: corpus -> tokenizer -> encode -> target -> distill -> drafts. Outputs go to the
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
from specdec.demo.train import TrainConfig, distill_rows, text_windows, train
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

    # 5. distillation sets: the target continues windows of each domain
    sets = {}
    for domain in ("python", "prose"):
        path = workdir / f"distill_{domain}.pt"
        if not path.exists():
            runner = ModelRunner(str(target_dir), max_num_seqs=recipe.distill_batch)
            gen = torch.Generator().manual_seed(recipe.seed + (1 if domain == "python" else 2))
            stream = streams[domain]
            starts = torch.randint(
                0,
                stream.numel() - recipe.distill_prompt_len,
                (recipe.distill_rows_per_domain,),
                generator=gen,
            )
            prompts = stream[starts[:, None] + torch.arange(recipe.distill_prompt_len)[None]]
            t0 = time.process_time()
            inputs, labels = generate_distillation_set(
                runner,
                prompts,
                recipe.distill_new_tokens,
                recipe.distill_batch,
                seed=recipe.seed,
                desc=f"distill {domain}",
            )
            torch.save({"inputs": inputs, "labels": labels}, path)
            record(
                f"distill_{domain}",
                {"rows": inputs.shape[0], "cpu_seconds": round(time.process_time() - t0)},
            )
            del runner
        sets[domain] = torch.load(path)

    # 6. drafts: general (both domains) and python-only (the drift scenario)
    for name, domains in (("demo-draft", ("python", "prose")), ("demo-draft-python", ("python",))):
        draft_dir = out / name
        if (draft_dir / "config.json").exists():
            continue
        torch.manual_seed(recipe.seed)
        model = LlamaForCausalLM(recipe.draft.config(len(tokenizer), eos))
        inputs = torch.cat([sets[d]["inputs"] for d in domains])
        labels = torch.cat([sets[d]["labels"] for d in domains])
        result = train(
            model,
            distill_rows(inputs, labels, recipe.draft_batch),
            recipe.draft_train,
            workdir / f"{name}.ckpt",
            f"train {name}",
        )
        result["params"] = sum(p.numel() for p in model.parameters())
        result["distill_domains"] = list(domains)
        record(name, result)
        _save_hf(model, tokenizer, draft_dir)
    return stats


def hash_key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
