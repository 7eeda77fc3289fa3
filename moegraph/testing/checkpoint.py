"""A random-weight model of a preset with a tokenizer and a chat template, built offline, in memory or saved.

For code written against the Hub (`AutoTokenizer.from_pretrained`, `apply_chat_template`,
`AutoModelForCausalLM.from_pretrained`, 4-bit loading), run without a download: `build_chat_model` gives
(model, tokenizer) of any preset on any device (the notebooks' preset mode, full size on a GPU);
`save_checkpoint` / `save_tiny_checkpoint` write them as a Hub checkpoint folder would be.

The tokenizer is a word-level `tokenizers` model: special tokens at the ids the config names
(`<|endoftext|>` at pad_token_id, `<|im_end|>` at eos_token_id, `<|im_start|>` after pad as in Qwen's
vocabulary: 0 / 2 / 1 for the tiny config, 151643 / 151645 / 151644 for Qwen3-30B-A3B), the words of a few
sentences, and filler words up to the model's vocabulary so that every id a random model samples decodes to
something. Its chat template writes Qwen's `<|im_start|>role ... <|im_end|>` turns.
"""

from __future__ import annotations

import os

import torch

from ..errors import InvalidArgumentError
from .models import CONFIGS, build_model

# ids fixed by the "tiny" config: pad_token_id=0, bos_token_id=1, eos_token_id=2
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
SENTENCES = (
    "Hello ! How are you today ?",
    "The capital of France is Paris .",
    "Tell me a short story about a robot who learns to paint .",
    "Explain mixture of experts models in one sentence .",
    "What is a CUDA graph and why does it make decoding fast ?",
    "system user assistant You are a helpful assistant .",
)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(vocab_size: int | None = None, *, pad_token_id: int = 0, eos_token_id: int = 2):
    """A PreTrainedTokenizerFast of exactly `vocab_size` tokens (default: the tiny config's), with a chat template;
    pad is `<|endoftext|>` at `pad_token_id`, eos `<|im_end|>` at `eos_token_id` (`<|endoftext|>` if they are equal)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_size = CONFIGS["tiny"]["vocab_size"] if vocab_size is None else vocab_size
    endoftext, im_start, im_end, unk = SPECIAL_TOKENS
    if not (0 <= pad_token_id < vocab_size and 0 <= eos_token_id < vocab_size):
        raise InvalidArgumentError(f"pad_token_id {pad_token_id} and eos_token_id {eos_token_id} must be "
                                   f"in [0, {vocab_size})")
    tokens: list[str | None] = [None] * vocab_size  # id -> token
    tokens[pad_token_id] = endoftext
    if tokens[eos_token_id] is None:
        tokens[eos_token_id] = im_end
    free = (i for i in range(vocab_size) if tokens[i] is None)
    rest = [t for t in SPECIAL_TOKENS if t not in tokens]
    if im_start in rest and pad_token_id + 1 < vocab_size and tokens[pad_token_id + 1] is None:
        tokens[pad_token_id + 1] = im_start
        rest.remove(im_start)
    words = rest + list(dict.fromkeys(" ".join(SENTENCES).split()))
    for word, i in zip(words, free):
        tokens[i] = word
    filler = 0
    for i in range(vocab_size):
        if tokens[i] is None:
            tokens[i], filler = f"w{filler}", filler + 1
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(tokens)}, unk_token=unk))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=endoftext, bos_token=None, eos_token=tokens[eos_token_id],
        unk_token=unk, padding_side="left", chat_template=CHAT_TEMPLATE,
    )


def build_chat_model(name: str = "tiny", *, num_layers: int | None = None, device="cpu",
                     dtype: torch.dtype = torch.float32, seed: int = 0, **kwargs):
    """(model, tokenizer): the preset's random-weight model (`build_model`, built on `device` in `dtype`; kwargs go
    to it) and an offline tokenizer of its vocabulary whose pad / eos ids are the config's, the generation config's
    pad / eos set from them, as a Hub checkpoint carries them."""
    model = build_model(name, device=device, dtype=dtype, seed=seed, num_layers=num_layers, **kwargs)
    text = model.config.get_text_config()
    eos = text.eos_token_id[0] if isinstance(text.eos_token_id, (list, tuple)) else text.eos_token_id
    pad = text.pad_token_id if text.pad_token_id is not None else 0
    tokenizer = build_tokenizer(text.vocab_size, pad_token_id=pad, eos_token_id=eos if eos is not None else pad)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def save_checkpoint(path: str | os.PathLike, name: str = "tiny", *, num_layers: int | None = None, device="cpu",
                    dtype: torch.dtype = torch.float32, seed: int = 0, **kwargs) -> str:
    """Save `build_chat_model(name, ...)` (model and tokenizer) to `path`, as a Hub checkpoint would be; returns path.
    The model is freed before returning (a full-size one holds tens of GB on `device`)."""
    path = os.fspath(path)
    model, tokenizer = build_chat_model(name, num_layers=num_layers, device=device, dtype=dtype, seed=seed, **kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    return path


def save_tiny_checkpoint(path: str | os.PathLike, *, seed: int = 0, num_layers: int | None = None, **overrides) -> str:
    """Save the tiny random model (fp32) and its offline tokenizer to `path`, as a Hub checkpoint would be; returns path."""
    return save_checkpoint(path, "tiny", seed=seed, num_layers=num_layers, **overrides)
