"""Model builders for tests and benchmarks: random weights, named configs, no downloads."""

from .checkpoint import build_chat_model, build_tokenizer, save_checkpoint, save_tiny_checkpoint
from .models import CONFIGS, build_model, make_config, random_prompts

__all__ = ["CONFIGS", "build_chat_model", "build_model", "build_tokenizer", "make_config", "random_prompts",
           "save_checkpoint", "save_tiny_checkpoint"]
