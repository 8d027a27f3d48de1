"""Tiny causal LMs and a tiny tokenizer, built inside the tests (no downloads).

Dimensions are multiples of 64 so that every pattern (N:M, hybrid 64x64 tiles) applies.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch

ARCHS = ("llama", "opt", "gpt2", "gpt_neox")
VOCAB = 320
HIDDEN = 64
LAYERS = 3

_WORDS = (
    "the of and to in is was for on as with by at from his her that which this were are be it an "
    "river city music army station season king church film album team game school language war "
    "north south early later first second great small old new long high low built played known "
    "called named began ended moved opened closed won lost made found held served wrote"
).split()


def corpus(n_words: int = 6000, seed: int = 0) -> str:
    """Deterministic pseudo-English text, with line breaks every few sentences."""
    rng = random.Random(seed)
    lines, line = [], []
    for i in range(n_words):
        line.append(rng.choice(_WORDS))
        if i % 17 == 16:
            lines.append(" ".join(line).capitalize() + " .")
            line = []
    return "\n".join(lines) + "\n"


def make_tokenizer(vocab_size: int = VOCAB):
    """A byte-level BPE tokenizer trained on :func:`corpus`, as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus().splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")


def make_config(arch: str, vocab_size: int = VOCAB):
    import transformers as T

    common = dict(vocab_size=vocab_size, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if arch == "llama":
        return T.LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             tie_word_embeddings=False, **common)
    if arch == "opt":
        return T.OPTConfig(hidden_size=HIDDEN, ffn_dim=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                           max_position_embeddings=256, word_embed_proj_dim=HIDDEN, dropout=0.0,
                           attention_dropout=0.0, activation_dropout=0.0, **common)
    if arch == "gpt2":
        return T.GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_positions=256, n_inner=128,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    if arch == "gpt_neox":
        return T.GPTNeoXConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                               num_attention_heads=4, max_position_embeddings=256, rotary_pct=0.5,
                               hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False, **common)
    raise ValueError(arch)


def make_model(arch: str, seed: int = 0, vocab_size: int = VOCAB):
    """A randomly initialised tiny causal LM in eval mode (fp32, CPU)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(arch, vocab_size))
    with torch.no_grad():  # wider weights than HF's 0.02 init, so that pruning choices matter
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    return model.eval()


def save_tiny(arch: str, path: str | Path, seed: int = 0, dtype: torch.dtype | None = None) -> Path:
    """Write a tiny model + tokenizer as an HF checkpoint directory (fp32 unless ``dtype``)."""
    path = Path(path)
    tok = make_tokenizer()
    model = make_model(arch, seed=seed, vocab_size=len(tok))
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_corpus(path: str | Path, seed: int = 1) -> Path:
    path = Path(path)
    path.write_text(corpus(seed=seed))
    return path


def make_workdir(d: Path, llama: str = "llama") -> Path:
    """A folder with a tiny Llama (under ``llama``), a tiny GPT-2 (``gpt2``) and a calibration corpus."""
    save_tiny("llama", d / llama)
    save_tiny("gpt2", d / "gpt2")
    write_corpus(d / "calib.txt")
    return d
