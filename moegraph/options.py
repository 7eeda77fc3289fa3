"""Settings given to `patch()`, validated once."""

from __future__ import annotations

from dataclasses import dataclass, fields

from .errors import InvalidArgumentError
from .moe.select import validate_backend_name

SAMPLING_MODES = ("auto", "device", "transformers")
PREFILL_MODES = ("auto", "transformers", "graphs")


@dataclass(frozen=True)
class PatchOptions:
    moe_backend: str = "auto"  # "auto" | "grouped_mm" | "triton" | "torch" (MOEGRAPH_MOE_BACKEND wins)
    cuda_graphs: bool = True  # False: decode with the same loop, eagerly
    max_batch_size: int = 16  # rows of the static KV cache; larger batches are split into chunks
    max_seq_len: int | None = None  # positions of the static cache; None: sized by the calls, grown on demand
    check_every: int = 8  # decode steps between host checks of "all rows finished"
    sampling: str = "auto"  # "auto" (device on CUDA) | "device" | "transformers" (its processors + multinomial)
    # "auto" (graphs on CUDA) | "transformers" (its forward) | "graphs": prompts of up to 512 tokens through
    # moegraph's decode step, one row per token, captured per bucket on CUDA (cuda_graph/prefill.py)
    prefill: str = "auto"

    def __post_init__(self):
        validate_backend_name(self.moe_backend)
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise InvalidArgumentError(f"max_batch_size must be a positive int, got {self.max_batch_size!r}")
        if self.max_seq_len is not None and (not isinstance(self.max_seq_len, int) or self.max_seq_len < 2):
            raise InvalidArgumentError(f"max_seq_len must be an int >= 2 or None (grow on demand), got {self.max_seq_len!r}")
        if not isinstance(self.check_every, int) or self.check_every < 1:
            raise InvalidArgumentError(f"check_every must be a positive int, got {self.check_every!r}")
        if self.prefill not in PREFILL_MODES:
            raise InvalidArgumentError(f"prefill must be one of {', '.join(map(repr, PREFILL_MODES))}, got "
                                       f"{self.prefill!r}")
        if self.sampling not in SAMPLING_MODES:
            raise InvalidArgumentError(f"sampling must be one of {', '.join(map(repr, SAMPLING_MODES))}, got "
                                       f"{self.sampling!r}")

    @classmethod
    def from_kwargs(cls, **options) -> "PatchOptions":
        """The options given to patch(), refusing a name that is not one of them."""
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise InvalidArgumentError(f"moegraph.patch() got unknown option(s) {', '.join(map(repr, unknown))}; "
                                       f"valid options: {', '.join(valid)}")
        return cls(**options)
