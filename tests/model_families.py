"""Tiny random models built from the real configs of the families people deploy.

Weights cannot be downloaded here, so each family is a pair of tiny random models whose
configs keep what decides correctness: vocabulary and embedding-row counts (padded past
the tokenizer where the family pads), GQA ratios, rope scaling, sliding windows and layer
types, soft-capping, tied or untied heads, learned positions, composite configs, and a
word-level tokenizer of the real size with the family's special-token ids and its BOS
behaviour. Only widths and depths are tiny.

Drafts are built from their target's weights (its first layer, the shared embedding
rows), so that a random pair agrees often enough for drafts to be accepted; the target's
second layer is strong enough that the draft also disagrees (rejections are exercised).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

# The target's second layer, scaled against its first (which the draft copies): how often
# the draft and the target disagree.
LAST_LAYER_SCALE = 0.5
# A window far shorter than the test prompts, so sliding layers matter.
WINDOW = 12


@dataclass(frozen=True)
class Family:
    name: str
    target: dict[str, Any]  # config kwargs of the target (model_type included)
    draft: dict[str, Any]  # overrides for the draft (fewer layers, other rows, other type)
    tokenizer_size: int
    specials: dict[str, int]  # special token -> its real id
    bos: str | None  # the token the tokenizer adds in front of text, if any
    eos: str
    chat_template: str | None = None
    draft_from_target: bool = True  # copy the target's weights into the draft
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


_SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
# DeepSeek-V3's attention and experts, tiny: keys of 16 + 8 beside values of 8 (in V3:
# 128 + 64 beside 128), low-rank q and kv projections.
_TINY_MLA = {
    **_SMALL,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "moe_intermediate_size": 32,
}
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|> {{ m['role'] }} "
    "<|end_header_id|> {{ m['content'] }} <|eot_id|> {% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|> assistant <|end_header_id|> {% endif %}"
)
_CHATML = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family(
            "llama3",
            {
                "model_type": "llama",
                "vocab_size": 128256,
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "rope_parameters": _LLAMA3_ROPE,
                "max_position_embeddings": 131072,
                "tie_word_embeddings": False,
                "bos_token_id": 128000,
                "eos_token_id": 128001,
            },
            {},
            128256,
            {
                "<|begin_of_text|>": 128000,
                "<|end_of_text|>": 128001,
                "<|eot_id|>": 128009,
                "<|start_header_id|>": 128006,
                "<|end_header_id|>": 128007,
            },
            "<|begin_of_text|>",
            "<|end_of_text|>",
            _LLAMA3_TEMPLATE,
        ),
        Family(
            "qwen2.5",  # 7B target: 152064 rows, untied; 0.5B draft: 151936 rows, tied
            {
                "model_type": "qwen2",
                "vocab_size": 152064,
                **_SMALL,
                "num_key_value_heads": 1,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                "max_position_embeddings": 32768,
                "tie_word_embeddings": False,
                "use_sliding_window": False,
                "bos_token_id": 151643,
                "eos_token_id": 151645,
            },
            {"vocab_size": 151936, "tie_word_embeddings": True},
            151665,
            {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645},
            None,
            "<|im_end|>",
            _CHATML,
        ),
        Family(
            "qwen3",  # q/k norms, head_dim independent of hidden / heads
            {
                "model_type": "qwen3",
                "vocab_size": 151936,
                **_SMALL,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                "max_position_embeddings": 40960,
                "tie_word_embeddings": True,
                "bos_token_id": 151643,
                "eos_token_id": 151645,
            },
            {},
            151669,
            {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645},
            None,
            "<|im_end|>",
            _CHATML,
        ),
        Family(
            "mistral",  # v0.1 shape: every layer slides
            {
                "model_type": "mistral",
                "vocab_size": 32000,
                **_SMALL,
                "num_key_value_heads": 1,
                "sliding_window": WINDOW,
                "max_position_embeddings": 32768,
                "tie_word_embeddings": False,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
            {},
            32000,
            {"<unk>": 0, "<s>": 1, "</s>": 2},
            "<s>",
            "</s>",
        ),
        Family(
            "gemma2",  # soft-capping (eager attention), alternating sliding / full layers
            {
                "model_type": "gemma2",
                "vocab_size": 256000,
                **_SMALL,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "query_pre_attn_scalar": 16,
                "sliding_window": WINDOW,
                "layer_types": ["sliding_attention", "full_attention"],
                "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0,
                "max_position_embeddings": 8192,
                "bos_token_id": 2,
                "eos_token_id": 1,
                "pad_token_id": 0,
            },
            {"layer_types": ["sliding_attention"]},
            256000,
            {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<end_of_turn>": 107},
            "<bos>",
            "<eos>",
        ),
        Family(
            "gemma3",  # >= 4B: a composite (vision + text) config; the 1B text model drafts
            {
                "model_type": "gemma3",
                "text_config": {
                    "model_type": "gemma3_text",
                    "vocab_size": 262208,
                    **_SMALL,
                    "num_key_value_heads": 2,
                    "head_dim": 16,
                    "query_pre_attn_scalar": 16,
                    "sliding_window": WINDOW,
                    "layer_types": ["sliding_attention", "full_attention"],
                    "max_position_embeddings": 131072,
                    "rope_parameters": {
                        "full_attention": {
                            "rope_type": "linear",
                            "factor": 8.0,
                            "rope_theta": 1000000.0,
                        },
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    },
                },
                "vision_config": {
                    "model_type": "siglip_vision_model",
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "image_size": 56,
                    "patch_size": 14,
                },
                "mm_tokens_per_image": 4,
                "boi_token_index": 255999,
                "eoi_token_index": 256000,
                "image_token_index": 262144,
                "bos_token_id": 2,
                "eos_token_id": 1,
                "pad_token_id": 0,
            },
            {},
            262145,
            {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<end_of_turn>": 106},
            "<bos>",
            "<eos>",
            draft_from_target=False,
            extra={"draft_text_only": True},
        ),
        Family(
            "phi3",  # Phi-3-mini-4k: 32064 rows over 32011 tokens, one window for all layers
            {
                "model_type": "phi3",
                "vocab_size": 32064,
                **_SMALL,
                "num_key_value_heads": 4,
                "sliding_window": WINDOW,
                "max_position_embeddings": 4096,
                "tie_word_embeddings": False,
                "bos_token_id": 1,
                "eos_token_id": 32000,
                "pad_token_id": 32000,
            },
            {},
            32011,
            {"<unk>": 0, "<s>": 1, "</s>": 2, "<|endoftext|>": 32000},
            None,
            "<|endoftext|>",
        ),
        Family(
            "gpt2",
            {
                "model_type": "gpt2",
                "vocab_size": 50257,
                "n_embd": 64,
                "n_head": 4,
                "n_positions": 1024,
                "bos_token_id": 50256,
                "eos_token_id": 50256,
            },
            {},
            50257,
            {"<|endoftext|>": 50256},
            None,
            "<|endoftext|>",
        ),
        Family(
            "opt",  # learned positions with OPT's offset of 2; the tokenizer prepends </s>
            {
                "model_type": "opt",
                "vocab_size": 50272,
                "hidden_size": 64,
                "ffn_dim": 128,
                "num_attention_heads": 4,
                "word_embed_proj_dim": 64,
                "max_position_embeddings": 2048,
                "bos_token_id": 2,
                "eos_token_id": 2,
                "pad_token_id": 1,
            },
            {},
            50265,
            {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3},
            "</s>",
            "</s>",
        ),
        Family(
            # Multi-head latent attention as transformers runs it: keys of qk_nope + qk_rope
            # (here 16 + 8, in V3 128 + 64) beside values of v_head_dim (8; V3 128), low-rank
            # q and kv projections, interleaved YaRN rope; layer 0 dense, then mixture of
            # experts with grouped routing (the draft keeps the dense layer)
            "deepseek-v3",
            {
                "model_type": "deepseek_v3",
                "vocab_size": 129280,
                **_TINY_MLA,
                "n_routed_experts": 4,
                "n_shared_experts": 1,
                "num_experts_per_tok": 2,
                "n_group": 2,
                "topk_group": 1,
                "first_k_dense_replace": 1,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 40.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                    "original_max_position_embeddings": 4096,
                },
                "max_position_embeddings": 163840,
                "tie_word_embeddings": False,
                "bos_token_id": 0,
                "eos_token_id": 1,
            },
            {},
            128815,  # 129280 embedding rows over the tokenizer's 128815 ids
            {"<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1, "<｜▁pad▁｜>": 2},
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
        ),
        Family(
            # Kimi K2: DeepSeek-V3's architecture (its checkpoints name DeepseekV3ForCausalLM)
            # with its own shape: a 163840-id vocabulary, one routing group, YaRN factor 32,
            # no BOS added by its tokenizer
            "kimi-k2",
            {
                "model_type": "deepseek_v3",
                "vocab_size": 163840,
                **_TINY_MLA,
                "n_routed_experts": 6,
                "n_shared_experts": 1,
                "num_experts_per_tok": 2,
                "n_group": 1,
                "topk_group": 1,
                "first_k_dense_replace": 1,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 50000.0,
                    "factor": 32.0,
                    "beta_fast": 1.0,
                    "beta_slow": 1.0,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                    "original_max_position_embeddings": 4096,
                },
                "max_position_embeddings": 131072,
                "tie_word_embeddings": False,
                "bos_token_id": 163584,
                "eos_token_id": 163585,
            },
            {},
            163840,
            {"[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586},
            None,
            "[EOS]",
        ),
        Family(
            "llama3-qwen2-draft",  # a draft of another family over the Llama 3 tokenizer
            {},  # filled from llama3 below
            {"model_type": "qwen2", "use_sliding_window": False},
            128256,
            {},
            "<|begin_of_text|>",
            "<|end_of_text|>",
        ),
    ]
}
_cross = FAMILIES["llama3-qwen2-draft"]
FAMILIES["llama3-qwen2-draft"] = Family(
    _cross.name,
    FAMILIES["llama3"].target,
    _cross.draft,
    _cross.tokenizer_size,
    FAMILIES["llama3"].specials,
    _cross.bos,
    _cross.eos,
    FAMILIES["llama3"].chat_template,
)

SERVED = [
    "llama3",
    "qwen2.5",
    "qwen3",
    "mistral",
    "gpt2",
    "opt",
    "deepseek-v3",
    "kimi-k2",
    "llama3-qwen2-draft",
]
SERVED_OR_REFUSED = ["gemma2", "gemma3", "phi3"]


def _layers_key(cfg: dict) -> str:
    return "n_layer" if cfg.get("model_type") == "gpt2" else "num_hidden_layers"


def build_tokenizer(family: Family, path: Path) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer with ``tokenizer_size`` ids: the family's special
    tokens at their real ids, words ``w<id>`` everywhere else."""
    vocab = {f"w{i}": i for i in range(family.tokenizer_size)}
    for tok, i in family.specials.items():
        del vocab[f"w{i}"]
        vocab[tok] = i
    unk = "<unk>" if "<unk>" in vocab else min(vocab, key=vocab.__getitem__)
    core = Tokenizer(WordLevel(vocab, unk_token=unk))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if family.bos is not None:
        core.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A", special_tokens=[(family.bos, vocab[family.bos])]
        )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=family.bos,
        eos_token=family.eos,
        unk_token=unk,
        additional_special_tokens=[
            t for t in family.specials if t not in (family.bos, family.eos, unk)
        ],
    )
    if family.chat_template:
        tok.chat_template = family.chat_template
    tok.save_pretrained(path)
    return tok


def _config(kwargs: dict):
    kwargs = dict(kwargs)
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def build_family(family: Family, root: Path, seed: int = 0) -> tuple[str, str, str]:
    """Save the family's target, draft and tokenizer under ``root``; returns their paths.

    The tokenizer has a directory of its own (``ModelSpec.tokenizer``): next to a
    ``config.json`` transformers 5 would rebuild it as the family's own tokenizer class
    (Qwen2Tokenizer's byte-level BPE), which a word-level stand-in is not."""
    target_dir, draft_dir, tok_dir = root / "target", root / "draft", root / "tokenizer"
    torch.manual_seed(seed)
    tcfg = dict(family.target)
    text = tcfg.get("text_config", tcfg)
    text[_layers_key(text)] = 2
    target = AutoModelForCausalLM.from_config(_config(tcfg))
    _sharpen(target, seed)
    if family.draft.get("tie_word_embeddings") and not tcfg.get("tie_word_embeddings", True):
        with torch.no_grad():  # an untied target whose head starts as its embedding (Qwen 2.5)
            target.get_output_embeddings().weight.copy_(target.get_input_embeddings().weight)
    target.save_pretrained(target_dir)
    build_tokenizer(family, tok_dir)

    if family.extra.get("draft_text_only"):  # Gemma 3: the 1B text-only model drafts
        dcfg = {**text, **family.draft, _layers_key(text): 1}
        dcfg["layer_types"] = text["layer_types"][:1]
        dcfg["vocab_size"] = text["vocab_size"]
    else:
        dcfg = {**tcfg, **family.draft}
        dcfg[_layers_key(dcfg)] = 1
        if "layer_types" in dcfg and "layer_types" not in family.draft:
            dcfg["layer_types"] = dcfg["layer_types"][:1]
    draft = AutoModelForCausalLM.from_config(_config(dcfg))
    _copy_shared(target, draft)
    draft.save_pretrained(draft_dir)
    return str(target_dir), str(draft_dir), str(tok_dir)


def _sharpen(model, seed: int) -> None:
    """Larger random weights than the init's, so the attention context (and therefore a
    sliding window) changes the next token, and greedy text is not a constant repetition
    (tied random models otherwise repeat the last token)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed_positions" not in name and "wpe" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1] ** 0.5))
                if _last_layer(name):
                    p.mul_(LAST_LAYER_SCALE)
        out = model.get_output_embeddings()
        if out is not None and out.weight is not model.get_input_embeddings().weight:
            out.weight.mul_(4.0)


def _last_layer(name: str) -> bool:
    return any(f"{part}.1." in name for part in ("layers", "h"))


def _copy_shared(target, draft) -> None:
    """Give the draft every target weight whose name it shares (the first layer, norms,
    embeddings over the shared rows), so that the pair agrees often but not always."""
    tstate = target.state_dict()
    with torch.no_grad():
        for name, p in draft.state_dict().items():
            src = tstate.get(name)
            if src is None:
                src = next(
                    (
                        v
                        for k, v in tstate.items()
                        if k.endswith(name.split("model.", 1)[-1]) and v.shape[1:] == p.shape[1:]
                    ),
                    None,
                )
            if src is None or src.shape[1:] != p.shape[1:]:
                continue
            rows = min(src.shape[0], p.shape[0]) if p.dim() else None
            if rows is None:
                p.copy_(src)
            else:
                p[:rows].copy_(src[:rows])
