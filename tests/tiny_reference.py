"""Reference helpers shared by the tests: tiny random-weight models with a tiny tokenizer,
and transformers-based references (greedy continuation, last-position logits)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_VOCAB = 512

_CORPUS = [
    "Once upon a time there was a knight named Loom who lived in a castle by the sea.",
    "The capital of France is Paris. The capital of Italy is Rome. 1 2 3 4 5 6 7 8 9 0",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # five\n",
    "She sells sea shells by the sea shore; the shells she sells are surely sea shells.",
    "Numbers: 3.14159, 2.71828, 42, 1000000. Symbols: !@#$%^&*()[]{}<>?/|\\~`'\"",
    "Über café naïve façade — déjà vu. 日本語のテキスト。 Emoji: 🙂🚀✨",
] * 20


# gpt-oss's harmony format's special tokens (a tiny harmony model's vocabulary ends in them).
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                  "<|return|>", "<|call|>", "<|startoftext|>", "<|endoftext|>")


def build_tiny_tokenizer(folder: Path, harmony: bool = False) -> int:
    """Train a byte-level BPE tokenizer of at most TINY_VOCAB tokens into `folder`; with
    `harmony`, HARMONY_TOKENS follow as special tokens and `<|return|>` is the end token.
    Returns the vocabulary's size (added tokens included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=["<pad>", "<eos>", "<bos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    if harmony:
        tok.add_special_tokens(list(HARMONY_TOKENS))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<bos>",
                "eos_token": "<|return|>" if harmony else "<eos>",
                "pad_token": "<pad>",
                "add_bos_token": not harmony,
            }
        )
    )
    return tok.get_vocab_size()


def tiny_hf_config(arch: str):
    """A small transformers config of the given architecture (vocab TINY_VOCAB)."""
    import transformers as tf

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    if arch == "gemma3":
        return tf.Gemma3TextConfig(
            **common,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
        )
    if arch == "llama":
        return tf.LlamaConfig(
            **common,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16)
    if arch == "qwen3_moe":  # 8 experts, 2 a token, renormalised; layer 1 dense
        return tf.Qwen3MoeConfig(**common, head_dim=16, moe_intermediate_size=32, num_experts=8,
                                 num_experts_per_tok=2, norm_topk_prob=True,
                                 mlp_only_layers=[1])
    if arch == "mixtral":  # 4 experts, 2 a token
        return tf.MixtralConfig(**{**common, "intermediate_size": 32}, num_local_experts=4,
                                num_experts_per_tok=2, sliding_window=None)
    if arch == "olmoe":  # 8 experts, 2 a token, not renormalised; QK-norm over all heads
        return tf.OlmoeConfig(**{**common, "intermediate_size": 32}, num_experts=8,
                              num_experts_per_tok=2, norm_topk_prob=False)
    raise ValueError(arch)


# Mixtures of experts: their routers are scaled by this in the tiny models. At the default
# init (std 0.02) every expert's probability is nearly equal, and which experts a token
# chooses would turn on rounding; scaled, the router's top-k is decided by margins of order
# one, as in a trained model.
ROUTER_GAIN = 50.0


def build_tiny_model(arch: str, folder: Path, seed: int = 0, qk_gain: float = 1.0):
    """Save a random-weight transformers model plus the tiny tokenizer into `folder`.

    `qk_gain` multiplies the q/k projections: at the default init (std 0.02) attention is
    nearly uniform and Llama and Qwen2 see token order weakly (swapping two tokens moves the
    logits by ~2e-3); a gain of 8 gives attention scores of order one (~5e-2). Gemma 3 and
    Qwen3 normalise q and k: for them the gain changes nothing.
    """
    import transformers as tf

    build_tiny_tokenizer(folder)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(tiny_hf_config(arch), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(qk_gain)
            elif name.endswith("mlp.gate.weight"):  # a mixture of experts' router
                p.mul_(ROUTER_GAIN)
    model.save_pretrained(str(folder))
    return model


TINY_ARCHS = ["gemma3", "llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "olmoe"]

# The tiny gpt-oss: its sliding layers' window (the tests' prompts are several windows
# long) and its YaRN (x8 over 32 positions, gpt-oss's unrounded ramp of 32 to 1 rotations).
GPT_OSS_WINDOW = 8
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 8.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32}


def tiny_gpt_oss_config():
    """transformers' GptOssConfig of the tiny gpt-oss: 3 layers (sliding, full, sliding),
    6 experts of width 32, 2 a token."""
    import transformers as tf

    return tf.GptOssConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=GPT_OSS_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        num_local_experts=6, num_experts_per_tok=2, max_position_embeddings=256,
        rope_parameters=dict(GPT_OSS_YARN), bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )


def tiny_gpt_oss(seed: int = 0):
    """A random tiny gpt-oss (transformers' GptOssForCausalLM, float32, eval mode).

    Attention scores, router logits and output logits of order one (q/k x8, the router x
    ROUTER_GAIN, the output projection x10), random nonzero sinks and biases, and experts x5
    (at the default init the model is nearly position-blind and its greedy tokens repeat).
    """
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(tiny_gpt_oss_config(), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.router.weight"):
                p.mul_(ROUTER_GAIN)
            elif name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.02)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
            elif ".experts." in name:
                p.mul_(5.0)
            elif name == "lm_head.weight":
                p.mul_(10.0)
    return model


def build_tiny_gpt_oss(folder: Path):
    """The tiny gpt-oss saved by transformers into `folder` (with the tiny tokenizer)."""
    build_tiny_tokenizer(folder)
    model = tiny_gpt_oss()
    model.save_pretrained(str(folder))
    return model


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by full forward passes (no cache): the plainest reference."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids) :]


def hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    """Float32 logits of the last position of one forward pass over `ids`."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


# Prompts and continuation length used by the real Gemma 3 270M tests (float32 and int8).
GEMMA_PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):\n",
    "Water boils at a temperature of",
]
GEMMA_NEW_TOKENS = 24
