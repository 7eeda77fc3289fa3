"""Random-weight MoE models (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, GLM-4-MoE, Qwen3-VL-MoE, GPT-OSS) built from
named configs, for tests and benchmarks.

No downloads: weights come from the model's own initializer under a fixed seed, created directly
on the target device in the target dtype (a 60 GB model never passes through CPU memory).
The router weights are random too: zero router weights would send every token to the same
experts and make a benchmark read far fewer expert bytes than a real model does. So are the
projection biases (Qwen2-MoE's and GLM-4-MoE's q/k/v, GPT-OSS's q/k/v/o), GPT-OSS's expert biases and GLM-4-MoE's
router correction bias (`e_score_correction_bias`), which transformers initializes to zero: a decode step that dropped
them would otherwise give the same tokens. GPT-OSS's attention sinks are drawn wide enough to matter too.
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import InvalidArgumentError

# model_type -> (config class, causal LM class) in transformers
_CLASSES = {"qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"), "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
            "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"), "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
            "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
            "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration"),
            "gpt_oss": ("GptOssConfig", "GptOssForCausalLM")}
# preset name -> model_type, where it is not qwen3_moe
MODEL_TYPES: dict[str, str] = {"tiny-mixtral": "mixtral", "mixtral-8x7b": "mixtral", "tiny-olmoe": "olmoe",
                               "olmoe-1b-7b": "olmoe", "tiny-qwen2-moe": "qwen2_moe",
                               "qwen1.5-moe-a2.7b": "qwen2_moe", "qwen2-57b-a14b": "qwen2_moe",
                               "tiny-glm4-moe": "glm4_moe", "glm4.5-air": "glm4_moe",
                               "tiny-qwen3-vl-moe": "qwen3_vl_moe", "qwen3-vl-30b-a3b": "qwen3_vl_moe",
                               "tiny-gpt-oss": "gpt_oss", "gpt-oss-20b": "gpt_oss"}

# name -> keyword arguments of its model type's config class
CONFIGS: dict[str, dict] = {
    # CPU tests: every code path of the real model at a size that runs in milliseconds.
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    # The real Qwen3-30B-A3B shapes.
    "qwen3-30b-a3b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
        pad_token_id=151643,
    ),
    # CPU tests of the Mixtral family: no q/k-norm, softmax top-2, every layer sparse.
    "tiny-mixtral": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=32,  # per expert
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        sliding_window=None,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    # The real Mixtral-8x7B(-Instruct)-v0.1 shapes (46.7B parameters, 93 GB in bf16); pad_token_id is not in its
    # config (token 0 is <unk>), set for batched random prompts.
    "mixtral-8x7b": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-5,
        sliding_window=None,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    # CPU tests of the OLMoE family: q/k-norm over the whole projections, softmax top-k not renormalised, GQA
    # (the real model has none; k_norm is then narrower than q_norm), every layer sparse.
    "tiny-olmoe": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=32,  # per expert
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        clip_qkv=None,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    # CPU tests of the Qwen2-MoE family: q/k/v biases, no q/k-norm, softmax top-4 not renormalised, a gated shared
    # expert in every sparse block, layer 1 dense (mlp_only_layers).
    "tiny-qwen2-moe": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,  # the dense layer
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=4,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        qkv_bias=True,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        use_sliding_window=False,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    # The real OLMoE-1B-7B-0924 shapes (6.9B parameters, 13.8 GB in bf16): transformers' OlmoeConfig defaults
    # (documented against that checkpoint) except the expert width, 1024 in its config.json.
    "olmoe-1b-7b": dict(
        vocab_size=50304,
        hidden_size=2048,
        intermediate_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=False,
        clip_qkv=None,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=50279,
        pad_token_id=1,
    ),
    # The real Qwen1.5-MoE-A2.7B shapes (config.json of the Hub checkpoint: 14.3B parameters, 28.6 GB in bf16; 60
    # routed experts, top-4, and a shared expert of 4 x 1408); pad_token_id is its tokenizer's (<|endoftext|>).
    "qwen1.5-moe-a2.7b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5632,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=60,
        num_experts_per_tok=4,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        qkv_bias=True,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        sliding_window=32768,
        max_window_layers=21,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151643,
        pad_token_id=151643,
    ),
    # The real Qwen2-57B-A14B shapes (config.json of the Hub checkpoint: 57.4B parameters, 115 GB in bf16; 64 routed
    # experts, top-8, a shared expert of 20480, GQA 28 / 4 heads).
    "qwen2-57b-a14b": dict(
        vocab_size=151936,
        hidden_size=3584,
        intermediate_size=18944,
        moe_intermediate_size=2560,
        shared_expert_intermediate_size=20480,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        qkv_bias=True,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        sliding_window=131072,
        max_window_layers=28,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151643,
        pad_token_id=151643,
    ),
    # CPU tests of the GLM-4-MoE family: sigmoid routing over 2 groups of 4 experts with topk_group 1 (both picks
    # from the best group), a random correction bias (build_model), routed_scaling_factor 2.5, renormalised; a
    # shared expert; layer 0 dense (first_k_dense_replace); partial RoPE (half of each head rotates); per-head
    # q/k-norm; q/k/v biases.
    "tiny-glm4-moe": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,  # the dense layer
        moe_intermediate_size=32,
        n_shared_experts=1,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        use_qk_norm=True,
        attention_bias=True,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    # The real GLM-4.5-Air shapes (106B parameters, 12B active): 46 layers, the first dense (10944), 128 routed
    # experts of 1408, top-8, one shared expert, sigmoid routing in one group, routed_scaling_factor 1.0, GQA 96 / 8
    # heads of 128, q/k/v biases, no q/k-norm, half of each head rotated (NVIDIA Megatron-Bridge's GLM 4.5 page and
    # the checkpoint's config.json as transformers prints it); pad_token_id is its config's.
    "glm4.5-air": dict(
        vocab_size=151552,
        hidden_size=4096,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        n_shared_experts=1,
        num_hidden_layers=46,
        num_attention_heads=96,
        num_key_value_heads=8,
        head_dim=128,
        n_routed_experts=128,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        first_k_dense_replace=1,
        use_qk_norm=False,
        attention_bias=True,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=[151329, 151336, 151338],
        pad_token_id=151329,
    ),
    # CPU tests of the Qwen3-VL-MoE family (a vision-language model: the config nests text_config and vision_config,
    # and make_config's num_layers and field overrides go to text_config): Qwen3-MoE's text decoder with an
    # always-renormalised router, interleaved mrope (sections summing to head_dim / 2), layer 1 dense
    # (mlp_only_layers); a 2-block vision tower with one DeepStack layer, small enough for an 8x8-patch image.
    "tiny-qwen3-vl-moe": dict(
        text_config=dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,  # the dense layer
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
            max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True},
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                           deepstack_visual_indexes=[0]),
        image_token_id=500,
        video_token_id=501,
        vision_start_token_id=502,
        vision_end_token_id=503,
        tie_word_embeddings=False,
    ),
    # The Qwen3-VL-30B-A3B(-Instruct) text decoder: Qwen3-30B-A3B's shapes (48 layers, hidden 2048, 128 experts
    # top-8 of width 768, GQA 32 / 4 heads of 128, untied lm_head, vocab 151936, as the checkpoint's Megatron
    # conversion arguments list them) with its 262144-token context and rope_theta 5e6; mrope_section [24, 20, 20]
    # interleaved (transformers' Qwen3VLMoe default). The vision tower is transformers' Qwen3VLMoeVisionConfig
    # default (documented against this checkpoint; not checked against its config.json) projecting to 2048.
    "qwen3-vl-30b-a3b": dict(
        text_config=dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            max_position_embeddings=262144,
            rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
                             "mrope_interleaved": True},
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            bos_token_id=151643,
            eos_token_id=151645,
            pad_token_id=151643,
        ),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=2048,
                           num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24]),
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        tie_word_embeddings=False,
    ),
    # CPU tests of the GPT-OSS family: q/k/v/o biases, attention sinks, layers alternating sliding (window 6, shorter
    # than the tests' longer prompts) and full attention (layer_types derived from num_hidden_layers), a biased
    # top-3 router, experts with biases and the clamped SwiGLU (limit 7, alpha 1.702: the config's defaults), YaRN
    # RoPE as the checkpoints use it (x32, over 1024 / 32 positions: transformers checks that ratio).
    "tiny-gpt-oss": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=32,  # per expert
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=3,
        sliding_window=6,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32},
        attention_bias=True,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    # The real gpt-oss-20b shapes (21B parameters, 3.6B active; config.json of the Hub checkpoint): 24 layers
    # alternating sliding (128) and full attention, GQA 64 / 8 heads of 64, 32 experts of 2880, top-4, vocab
    # 201088, YaRN x32 over 4096 positions; eos <|return|>, pad <|endoftext|>. In bf16 (what the MXFP4 checkpoint
    # dequantizes to) about 42 GB. gpt-oss-120b: 36 layers, 128 experts, otherwise the same.
    "gpt-oss-20b": dict(
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
        rms_norm_eps=1e-5,
        attention_bias=True,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=200002,
        pad_token_id=199999,
    ),
}


def model_type_of(name: str) -> str:
    """The transformers model_type of a preset."""
    return MODEL_TYPES.get(name, "qwen3_moe")


def _classes(name: str):
    import transformers

    config_class, model_class = _CLASSES[model_type_of(name)]
    return getattr(transformers, config_class), getattr(transformers, model_class)


def make_config(name: str = "tiny", *, num_layers: int | None = None, **overrides):
    """The config (Qwen3MoeConfig, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Glm4MoeConfig) of a named preset; `num_layers` and
    any config field can be overridden."""
    if name not in CONFIGS:
        raise InvalidArgumentError(f"unknown model config {name!r}; choose one of {sorted(CONFIGS)}")
    kwargs = dict(CONFIGS[name])
    text = kwargs  # where the decoder's fields go: a vision-language preset nests them in text_config
    if "text_config" in kwargs:
        text = kwargs["text_config"] = dict(kwargs["text_config"])
    if num_layers is not None:
        if num_layers < 1:
            raise InvalidArgumentError(f"num_layers must be >= 1, got {num_layers}")
        text["num_hidden_layers"] = num_layers
    for key, value in overrides.items():
        (kwargs if key in kwargs else text)[key] = value
    return _classes(name)[0](**kwargs)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    name: str = "tiny",
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    num_layers: int | None = None,
    attn_implementation: str | None = None,
    experts_implementation: str | None = None,
    quant: str | None = None,
    double_quant: bool = False,
    **overrides,
):
    """The preset's causal LM (Qwen3MoeForCausalLM, MixtralForCausalLM, ...) with random weights,
    built on `device` in `dtype`, deterministic by seed.

    quant="nf4": the model as `from_pretrained(..., BitsAndBytesConfig(load_in_4bit=True))` with moegraph
    loads it (experts in moegraph's NF4, projections as bitsandbytes Linear4bit, lm_head dense), built one
    decoder layer at a time so that peak memory stays near the 4-bit size plus one dense layer.
    """
    if quant not in (None, "nf4"):
        raise InvalidArgumentError(f"quant={quant!r}: choose None or 'nf4'")
    config = make_config(name, num_layers=num_layers, **overrides)
    model_class = _classes(name)[1]
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    if experts_implementation is not None:
        config._experts_implementation = experts_implementation
    torch.manual_seed(seed)
    if quant == "nf4":
        return _build_nf4(model_class, config, device, dtype, double_quant).eval()
    with torch.device(device), _default_dtype(dtype):
        model = model_class(config)
    _randomize_biases(model, config.get_text_config().initializer_range)
    return model.eval()


@torch.no_grad()
def _randomize_biases(module: torch.nn.Module, std: float) -> None:
    """Every nn.Linear bias and every expert bias (GPT-OSS) drawn like the weights, every router correction bias
    (GLM-4-MoE's `e_score_correction_bias`) 5x wider, as wide as the spread of the sigmoid scores of random router
    weights, so that it changes which experts are picked and the tokens (transformers' _init_weights zeroes them
    all), and GPT-OSS's attention sinks with std 1 (transformers' 0.02 would make them near-zero logits)."""
    for sub in module.modules():
        if isinstance(sub, torch.nn.Linear) and sub.bias is not None:
            sub.bias.normal_(0.0, std)
        correction = getattr(sub, "e_score_correction_bias", None)
        if isinstance(correction, torch.Tensor):
            correction.normal_(0.0, 5 * std)
        for name in ("gate_up_proj_bias", "down_proj_bias"):  # GPT-OSS's experts
            bias = sub._parameters.get(name)
            if bias is not None:
                bias.normal_(0.0, std)
        sinks = sub._parameters.get("sinks")  # GPT-OSS's attention sinks, near the scores' own scale
        if sinks is not None:
            sinks.normal_(0.0, 1.0)


def _build_nf4(model_class, config, device, dtype, double_quant: bool):
    """Build on the meta device, then materialize, initialize and quantize one piece at a time."""
    from ..quant.experts import quantize_experts
    from ..quant.projections import quantize_projections

    if config.get_text_config() is not config:
        raise InvalidArgumentError(f"quant='nf4' builds text-only models; {model_class.__name__} is not one")

    with torch.device("meta"), _default_dtype(dtype):
        model = model_class(config)
    layers = list(model.model.layers)
    rest = [m for n, m in model.model.named_children() if n != "layers"]
    rest += [m for n, m in model.named_children() if n != "model"]
    for module in rest + layers:
        module.to_empty(device=device, recurse=True)
        for sub in module.modules():
            model._init_weights(sub)
        _randomize_biases(module, config.initializer_range)
        if any(module is layer for layer in layers):
            quantize_experts(module, double_quant=double_quant)
            quantize_projections(module, double_quant=double_quant, skip=())
    return model


def random_prompts(batch_size: int, *, vocab_size: int, min_len: int = 4, max_len: int = 16, seed: int = 0,
                   pad_token_id: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """Left-padded `input_ids` + `attention_mask` of random token ids, lengths in [min_len, max_len]."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch_size,), generator=gen)
    width = int(lengths.max())
    input_ids = torch.full((batch_size, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, width), dtype=torch.long)
    for row, length in enumerate(lengths.tolist()):
        input_ids[row, width - length:] = torch.randint(3, vocab_size, (length,), generator=gen)
        attention_mask[row, width - length:] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
