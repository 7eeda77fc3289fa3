"""A local checkpoint of a tiny random Qwen3-MoE with a tokenizer and a chat template, built offline.

For code written against the Hub (`AutoTokenizer.from_pretrained`, `apply_chat_template`,
`AutoModelForCausalLM.from_pretrained`, 4-bit loading), run in CI without a download: the notebooks'
CI mode points them at a folder made by `save_tiny_checkpoint`.

The tokenizer is a word-level `tokenizers` model: special tokens at the ids the tiny config names
(pad 0, bos 1, eos 2), the words of a few sentences, and filler words up to the model's vocabulary so
that every id a random model samples decodes to something. Its chat template writes Qwen's
`<|im_start|>role ... <|im_end|>` turns.
"""

from __future__ import annotations

import os

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


def build_tokenizer(vocab_size: int | None = None):
    """A PreTrainedTokenizerFast of exactly `vocab_size` tokens (default: the tiny config's), with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_size = CONFIGS["tiny"]["vocab_size"] if vocab_size is None else vocab_size
    words = list(SPECIAL_TOKENS)
    for word in " ".join(SENTENCES).split():
        if word not in words:
            words.append(word)
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    assert len(words) == vocab_size, (len(words), vocab_size)
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<|endoftext|>", bos_token=None, eos_token="<|im_end|>",
        unk_token="<unk>", padding_side="left", chat_template=CHAT_TEMPLATE,
    )


def save_tiny_checkpoint(path: str | os.PathLike, *, seed: int = 0, num_layers: int | None = None, **overrides) -> str:
    """Save the tiny random model (fp32) and its offline tokenizer to `path`, as a Hub checkpoint would be; returns path."""
    path = os.fspath(path)
    model = build_model("tiny", seed=seed, num_layers=num_layers, **overrides)
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.save_pretrained(path)
    build_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path
