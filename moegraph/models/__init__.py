"""Model families moegraph accelerates, keyed by `config.model_type`; each family owns its model code.

A family is one entry here and one module beside this file (`qwen3_moe.py`, `mixtral.py`, `olmoe.py`,
`qwen2_moe.py`, `glm4_moe.py`, `qwen3_vl_moe.py`, `gpt_oss.py`) holding its decode step: the whole one-token forward over the
static cache that the graph decoder captures (attention variant, norm placement, router, experts), built from the
shared ops of moegraph.ops, and, where the family needs them, its checks: `check_positions(model, positions)`, the
longest call its step decodes exactly (e.g. a sliding window); `check_prompt(model, attention_mask, positions)`, a
limit that depends on the call's attention_mask too (GPT-OSS: where the padding sits, once a sliding window could be
outgrown); `INPUT_KWARGS` with `check_inputs(model, inputs)`, model kwargs beyond the text ones and when a call
with them stays on the fast path (Qwen3-VL-MoE: text-only calls); `text_position_ids(position_ids)`, for RoPE with
several position components. The graph decoder (cuda_graph/) is handed these as one `FamilySteps`
(`ModelFamily.steps()`) and knows nothing of any model.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from ..cuda_graph.family import FamilySteps
from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    modeling_module: str  # where transformers defines the classes below
    sparse_block_class: str  # router + experts; the experts dispatch through transformers' ExpertsInterface
    causal_lm_class: str  # its generate is wrapped by the graph decoder
    pretrained_class: str  # the family's PreTrainedModel: the class-level patch makes moegraph its default experts
    decode_module: str  # moegraph's module for the family: `decode_forward(model, cache, token_ids, positions, ops,
    #                     rope_positions)` -> logits [b, V] float32, one step for every row
    models: str = ""  # the checkpoints it covers, for error messages and the README

    def module(self):
        return importlib.import_module(self.modeling_module)

    def sparse_block(self) -> type:
        return getattr(self.module(), self.sparse_block_class)

    def causal_lm(self) -> type:
        return getattr(self.module(), self.causal_lm_class)

    def pretrained_model(self) -> type:
        return getattr(self.module(), self.pretrained_class)

    def steps(self) -> FamilySteps:
        """What the graph decoder runs and asks of this family: the module's decode_forward and whichever of the
        optional hooks it defines (check_positions, check_prompt, INPUT_KWARGS with check_inputs,
        text_position_ids; see moegraph.cuda_graph.family)."""
        module = importlib.import_module(self.decode_module)
        return FamilySteps(decode_step=module.decode_forward,
                           check_positions=getattr(module, "check_positions", None),
                           check_prompt=getattr(module, "check_prompt", None),
                           input_kwargs=getattr(module, "INPUT_KWARGS", frozenset()),
                           check_inputs=getattr(module, "check_inputs", None),
                           text_position_ids=getattr(module, "text_position_ids", None))


FAMILIES: dict[str, ModelFamily] = {
    "qwen3_moe": ModelFamily(
        model_type="qwen3_moe",
        modeling_module="transformers.models.qwen3_moe.modeling_qwen3_moe",
        sparse_block_class="Qwen3MoeSparseMoeBlock",
        causal_lm_class="Qwen3MoeForCausalLM",
        pretrained_class="Qwen3MoePreTrainedModel",
        decode_module="moegraph.models.qwen3_moe",
        models="Qwen3-MoE: Qwen3-30B-A3B and its family",
    ),
    "mixtral": ModelFamily(
        model_type="mixtral",
        modeling_module="transformers.models.mixtral.modeling_mixtral",
        sparse_block_class="MixtralSparseMoeBlock",
        causal_lm_class="MixtralForCausalLM",
        pretrained_class="MixtralPreTrainedModel",
        decode_module="moegraph.models.mixtral",
        models="Mixtral: Mixtral-8x7B, Mixtral-8x22B",
    ),
    "olmoe": ModelFamily(
        model_type="olmoe",
        modeling_module="transformers.models.olmoe.modeling_olmoe",
        sparse_block_class="OlmoeSparseMoeBlock",
        causal_lm_class="OlmoeForCausalLM",
        pretrained_class="OlmoePreTrainedModel",
        decode_module="moegraph.models.olmoe",
        models="OLMoE: OLMoE-1B-7B",
    ),
    "qwen2_moe": ModelFamily(
        model_type="qwen2_moe",
        modeling_module="transformers.models.qwen2_moe.modeling_qwen2_moe",
        sparse_block_class="Qwen2MoeSparseMoeBlock",
        causal_lm_class="Qwen2MoeForCausalLM",
        pretrained_class="Qwen2MoePreTrainedModel",
        decode_module="moegraph.models.qwen2_moe",
        models="Qwen2-MoE: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B",
    ),
    "glm4_moe": ModelFamily(
        model_type="glm4_moe",
        modeling_module="transformers.models.glm4_moe.modeling_glm4_moe",
        sparse_block_class="Glm4MoeMoE",
        causal_lm_class="Glm4MoeForCausalLM",
        pretrained_class="Glm4MoePreTrainedModel",
        decode_module="moegraph.models.glm4_moe",
        models="GLM-4-MoE: GLM-4.5-Air, GLM-4.5, GLM-4.6",
    ),
    "qwen3_vl_moe": ModelFamily(
        model_type="qwen3_vl_moe",
        modeling_module="transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe",
        sparse_block_class="Qwen3VLMoeTextSparseMoeBlock",
        causal_lm_class="Qwen3VLMoeForConditionalGeneration",
        pretrained_class="Qwen3VLMoePreTrainedModel",
        decode_module="moegraph.models.qwen3_vl_moe",
        models="Qwen3-VL-MoE: Qwen3-VL-30B-A3B (text-only calls; images and videos go to transformers)",
    ),
    "gpt_oss": ModelFamily(
        model_type="gpt_oss",
        modeling_module="transformers.models.gpt_oss.modeling_gpt_oss",
        sparse_block_class="GptOssMLP",
        causal_lm_class="GptOssForCausalLM",
        pretrained_class="GptOssPreTrainedModel",
        decode_module="moegraph.models.gpt_oss",
        models="GPT-OSS: gpt-oss-20b, gpt-oss-120b (MXFP4 checkpoints dequantized to bf16 at load)",
    ),
}


def decoder_stack(model):
    """The module holding the decoder layers (layers, embed_tokens, norm, rotary_emb): `model.model`, or a
    vision-language model's text decoder, `model.model.language_model` (transformers' name for it, e.g. Qwen3-VL-MoE).
    Its config is `model.config.get_text_config()`."""
    inner = model.model
    return getattr(inner, "language_model", inner)


def family_of(model) -> ModelFamily:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        found = f"model_type={model_type!r}" if model_type else "no `config.model_type`"
        raise UnsupportedModelError(
            f"moegraph.patch() got {type(model).__name__} with {found}; supported model types: "
            f"{sorted(FAMILIES)} ({'; '.join(FAMILIES[name].models for name in sorted(FAMILIES))}). "
            "Leave other models unpatched."
        )
    return FAMILIES[model_type]
