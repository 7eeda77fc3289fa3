"""Model builders for tests and benchmarks: random weights, named configs, no downloads."""

from .models import CONFIGS, build_model, make_config, random_prompts

__all__ = ["CONFIGS", "build_model", "make_config", "random_prompts"]
