"""The decode step's ops: one typed table, chosen once per (device, dtype, weight formats, MoE backend).

Every op that the graph decoder's step and moegraph's experts functions (registered in transformers'
ExpertsInterface, moe/interface.py) run comes from an `OpTable`.
`resolve_ops()` builds it once per key, from the backend probes (moe/select.py) and the formats
of the weights, and records why each op was chosen (`python -m moegraph info` prints it):
- norms, q/k-norm + RoPE + cache write, decode attention, router top-k, expert grouping: moegraph's Triton kernels
  on CUDA, their plain-torch references elsewhere (the kernel tests run the kernels on the CPU
  through Triton's interpreter; `kernels="triton"` forces them for such a test);
- experts: the MoE backend the probe accepted for the experts' weight format (under torch.compile: the
  traceable grouped_mm path of that format, moe/select.py's COMPILED_EXPERT_FUNCTIONS);
- projections: moegraph's GEMV for dense weights at decode batch sizes (a plain linear above them or without
  Triton), moegraph's NF4 GEMV or bitsandbytes' own forward for `Linear4bit`.
Nothing re-decides per layer or per call: callers hold the table, or look it up by its key.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .errors import InvalidArgumentError
from .kernels import (advance, decode_attention, gemv, moe_align, moe_combine, qk_norm_rope, rms_norm, router_topk,
                      silu_mul, triton_available, triton_dtype_problem)
from .moe.select import COMPILED_REASON, expert_function, describe_moe_backend, normalize_device

DENSE = "dense"  # expert or projection weights as plain tensors in the compute dtype
NF4 = "nf4"  # experts in moegraph's NF4 format (moegraph/quant)
LINEAR4BIT = "linear4bit"  # projections as bitsandbytes Linear4bit
KERNEL_CHOICES = ("auto", "triton", "torch")
# The norms before attention and the router inside the GEMVs after them (ops_for_model's default). None: by the
# projections' format: fused for dense ones; not for Linear4bit, whose q/k/v GEMV then reads x as it is in memory
# and takes the words lookup (kernels/nf4_gemv.py): H100, 48 layers, NF4 batch 1 2.53 ms a step unfused against
# 2.63 fused, batch 8 7.15 either way; bf16 within 0.1% either way (ab_decode.py fuse_norms, 2026-12-06). Since
# then the fused NF4 q/k/v runs the words lookup behind its norm too (nf4_gemv.NORMED_WORDS), untimed: the next
# fuse_norms A/B decides whether 4-bit projections fuse again. True / False forces it (a benchmark's A/B).
FUSE_NORMS = None
# The router's norm alone: None as the one before attention; True / False forces it (untimed with 4-bit
# projections, where the router's GEMV is the dense one: ab_decode.py fuse_router_norm).
FUSE_ROUTER_NORM = None


@dataclass(frozen=True)
class WeightFormats:
    experts: str = DENSE
    projections: str = DENSE


@dataclass(frozen=True)
class OpTable:
    device: torch.device
    dtype: torch.dtype  # compute dtype of the experts
    formats: WeightFormats
    moe_backend: str
    capture_safe: bool  # every op may run inside a captured CUDA graph
    rms_norm: Callable
    add_rms_norm: Callable
    qk_norm_rope: Callable
    decode_attention: Callable  # (q [b, Hq, D], key/value cache, positions [b], scale, window, sinks) -> [b, Hq, D]
    router_logits: Callable  # (hidden [b, H], weight [E, H]) -> [b, E]: hidden @ weight.T in hidden's dtype
    router_topk: Callable
    moe_align: Callable
    silu_mul: Callable
    moe_combine: Callable
    advance: Callable  # the loop's bookkeeping between two steps (kernels/advance.py)
    experts: Callable  # (hidden [T, H], top_k_index [T, K], top_k_weights [T, K], experts, ops) -> [T, H]
    linear: Callable  # (module, x) -> module(x) for a projection
    qkv: Callable  # (attention module, x) -> (q_proj(x), k_proj(x), v_proj(x))
    # (RMSNorm module, residual, x or None, attention module) -> (residual + x, qkv(attn, norm(residual + x)))
    add_norm_qkv: Callable
    # (RMSNorm module, residual, x, router weight [E, H]) -> (residual + x, hidden = norm(residual + x),
    # router_logits(hidden, weight))
    add_norm_router: Callable
    reasons: tuple[tuple[str, str, str], ...]  # (op, choice, why)

    @property
    def pdl_early_trigger(self) -> bool:
        """Where the decode graphs' kernels let the next one launch (kernels/_triton.py): at their start for dense
        weights, after their wait for 4-bit ones. H100, 48 layers, NF4 experts and projections (ab_decode.py
        pdl_late_trigger, 2026-12-06): 2.63 / 7.16 ms a step at batch 1 / 8 after the wait, 3.31 / 7.44 at the
        start, where a chain of early launches waits ahead of the NF4 kernels; bf16 3.29 / 10.89 at the start,
        3.33 / 10.92 after the wait."""
        return self.formats.experts != NF4 and self.formats.projections != LINEAR4BIT

    def describe(self) -> str:
        head = (f"decode ops for {self.dtype} on {self.device} (experts {self.formats.experts}, projections "
                f"{self.formats.projections}): {'capture-safe' if self.capture_safe else 'eager only'}")
        return "\n".join([head] + [f"  {op:<13} {choice:<11} {why}" for op, choice, why in self.reasons])


_FUSED = dict(rms_norm=rms_norm.rms_norm, add_rms_norm=rms_norm.add_rms_norm, qk_norm_rope=qk_norm_rope.qk_norm_rope,
              decode_attention=decode_attention.decode_attention,
              router_topk=router_topk.router_topk, moe_align=moe_align.moe_align, silu_mul=silu_mul.silu_mul,
              moe_combine=moe_combine.moe_combine, advance=advance.advance)
_REFERENCE = dict(rms_norm=rms_norm.rms_norm_ref, add_rms_norm=rms_norm.add_rms_norm_ref,
                  qk_norm_rope=qk_norm_rope.qk_norm_rope_ref, decode_attention=decode_attention.decode_attention_ref,
                  router_topk=router_topk.router_topk_ref,
                  moe_align=moe_align.moe_align_ref, silu_mul=silu_mul.silu_mul_ref,
                  moe_combine=moe_combine.moe_combine_ref, advance=advance.advance_ref)


def _dense_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if type(module) is not nn.Linear:  # e.g. bitsandbytes' 8-bit or a user's wrapper: its own forward knows
        return module(x)
    return nn.functional.linear(x, module.weight, module.bias)


def _gemv_takes(weight: torch.Tensor, x: torch.Tensor, max_rows: int) -> bool:
    """Whether moegraph's GEMV runs x @ weight.T: few rows (where it beats cuBLAS: kernels/gemv.py), not too wide."""
    return (x.dim() == 2 and x.shape[0] <= max_rows and weight.shape[0] < gemv.WIDE_N and weight.dtype == x.dtype
            and weight.is_contiguous())


def _gemv_form(weights, x: torch.Tensor, fma_rows: int) -> str | None:
    """How moegraph's GEMV runs x times these weights: "fma" up to fma_rows rows, "dot" (tensor cores) up to
    gemv.DOT_MAX_ROWS, None where torch's linear does (more rows, a weight it does not take)."""
    rows = x.shape[0] if x.dim() == 2 else gemv.WIDE_N
    for form, limit in (("fma", fma_rows), ("dot", gemv.DOT_MAX_ROWS)):
        if rows <= limit and all(_gemv_takes(w, x, limit) for w in weights):
            return form
    return None


def _linear_weights(modules) -> list | None:
    """The weights of plain nn.Linear modules (None if any is another kind: its own forward knows)."""
    return [m.weight for m in modules] if all(type(m) is nn.Linear for m in modules) else None


def _router_logits_gemv(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if _gemv_takes(weight, hidden, gemv.ROUTER_MAX_ROWS):
        return gemv.linear_gemv(hidden, weight)
    return nn.functional.linear(hidden, weight)


def _router_logits_linear(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(hidden, weight)


def _dense_gemv_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A plain nn.Linear at decode batch sizes through moegraph's GEMV; anything else as _dense_linear does."""
    weights = _linear_weights([module])
    form = _gemv_form(weights, x, gemv.LINEAR_MAX_ROWS) if weights else None
    if form is not None:
        bias = None if module.bias is None else [module.bias]
        return gemv.linear_gemv_group(x, weights, bias, use_dot=form == "dot")[0]
    return _dense_linear(module, x)


def _qkv_group(attn: nn.Module, x: torch.Tensor):
    """(weights, biases or None, GEMV form) of q, k and v in one launch, or None where they do not go together."""
    modules = (attn.q_proj, attn.k_proj, attn.v_proj)
    weights, with_bias = _linear_weights(modules), {m.bias is not None for m in modules}
    form = _gemv_form(weights, x, gemv.QKV_MAX_ROWS) if weights and len(with_bias) == 1 else None
    if form is None:
        return None
    return weights, [m.bias for m in modules] if with_bias.pop() else None, form


def _dense_gemv_qkv(attn: nn.Module, x: torch.Tensor):
    """q, k and v in one GEMV launch over the modules' own weights (all biased or none), else one by one."""
    group = _qkv_group(attn, x)
    if group is None:
        return _qkv_one_by_one(_dense_gemv_linear, attn, x)
    weights, biases, form = group
    return gemv.linear_gemv_group(x, weights, biases, use_dot=form == "dot")


def _add_norm_then_qkv(rms_norm_op: Callable, add_rms_norm_op: Callable, qkv: Callable, norm: nn.Module,
                       residual: torch.Tensor, x: torch.Tensor | None, attn: nn.Module):
    """The unfused add_norm_qkv: the table's norm op, then its q/k/v op."""
    if x is None:
        hidden = rms_norm_op(residual, norm.weight, norm.variance_epsilon)
    else:
        residual, hidden = add_rms_norm_op(residual, x, norm.weight, norm.variance_epsilon)
    return residual, qkv(attn, hidden)


def _dense_gemv_add_norm_qkv(unfused: Callable, norm: nn.Module, residual: torch.Tensor, x: torch.Tensor | None,
                             attn: nn.Module):
    """add + RMSNorm + q/k/v in one GEMV launch (kernels/gemv.py) where the q/k/v GEMV takes the rows and the norm
    weight is of their dtype; otherwise `unfused`."""
    group = _qkv_group(attn, residual)
    if group is None or norm.weight.dtype != residual.dtype or (group[2] == "fma"
                                                                and residual.shape[0] > gemv.NORM_MAX_ROWS):
        return unfused(norm, residual, x, attn)
    weights, biases, form = group
    return gemv.add_rms_norm_gemv_group(residual, x, norm.weight, norm.variance_epsilon, weights, biases,
                                        use_dot=form == "dot")


def _add_norm_then_router(add_rms_norm_op: Callable, router_logits: Callable, norm: nn.Module,
                          residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor):
    """The unfused add_norm_router: the table's norm op, then its router logits."""
    residual, hidden = add_rms_norm_op(residual, x, norm.weight, norm.variance_epsilon)
    return residual, hidden, router_logits(hidden, weight)


def _gemv_add_norm_router(unfused: Callable, norm: nn.Module, residual: torch.Tensor, x: torch.Tensor,
                          weight: torch.Tensor):
    """add + RMSNorm + router logits in one GEMV launch that also writes the normalized rows (kernels/gemv.py),
    where the GEMV takes the rows; otherwise `unfused`."""
    if not _gemv_takes(weight, residual, gemv.NORM_MAX_ROWS) or norm.weight.dtype != residual.dtype:
        return unfused(norm, residual, x, weight)
    return gemv.add_rms_norm_gemv(residual, x, norm.weight, norm.variance_epsilon, weight)


def _module_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


MAX_GEMV_ROWS = 16  # nf4_linear is a decode GEMV; more rows (prefill-sized) go to bitsandbytes' own forward


def _gemv_state(module: nn.Module, x: torch.Tensor):
    """The bitsandbytes quant state of a Linear4bit that moegraph's NF4 GEMV takes for x, else None."""
    state = getattr(getattr(module, "weight", None), "quant_state", None)
    if state is None or state.quant_type != "nf4" or state.blocksize != 64 or x.shape[0] > MAX_GEMV_ROWS:
        return None
    # bitsandbytes (>= 0.49) repacks a Linear4bit in place on its first CPU forward where the CPU has AVX512-BF16:
    # another byte order and bf16 absmax. Only its own forward reads that layout.
    if getattr(state, "packing_format_for_cpu", False):
        return None
    return state


def _compute_dtype(module: nn.Module, x: torch.Tensor) -> torch.dtype:
    """The dtype moegraph's NF4 GEMV computes a Linear4bit in for rows x: the module's compute_dtype, except float32
    (BitsAndBytesConfig's default) on 16-bit rows below DOT_MIN_M: there the GEMV multiplies the exact float32
    weights with x and sums in float32 whatever x's type, so x stays as it is (its words lookup reads 16-bit x) and
    the output is rounded once to x's type, as bitsandbytes' forward rounds its float32 output."""
    from .kernels.nf4_gemv import DOT_MIN_M

    compute = getattr(module, "compute_dtype", None) or x.dtype
    if compute == torch.float32 and x.dtype in (torch.bfloat16, torch.float16) and x.shape[0] < DOT_MIN_M:
        return x.dtype
    return compute


def _nf4_gemv_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A bitsandbytes NF4 Linear4bit through moegraph's capture-safe GEMV; anything else through its forward."""
    state = _gemv_state(module, x)
    if state is None:
        return module(x)
    from .kernels.nf4_gemv import nf4_linear

    nested = dict(nested_code=state.state2.code, nested_absmax=state.state2.absmax,
                  offset=state.offset) if state.nested else {}
    out = nf4_linear(x.to(_compute_dtype(module, x)), module.weight.data, state.absmax, state.code, state.shape[0],
                     state.shape[1], module.bias, **nested)
    return out.to(x.dtype)


def _qkv_one_by_one(linear: Callable, attn: nn.Module, x: torch.Tensor):
    return linear(attn.q_proj, x), linear(attn.k_proj, x), linear(attn.v_proj, x)


def _nf4_gemv_qkv(attn: nn.Module, x: torch.Tensor):
    """q, k, v Linear4bit projections in one NF4 GEMV launch where they allow it (NF4, all with a bias or none,
    e.g. Qwen2-MoE's q/k/v biases; one compute dtype; all double-quantized or none); otherwise one by one."""
    modules = (attn.q_proj, attn.k_proj, attn.v_proj)
    states = [_gemv_state(m, x) for m in modules]
    dtypes = {_compute_dtype(m, x) for m in modules}
    with_bias = {m.bias is not None for m in modules}
    if (any(s is None for s in states) or len(with_bias) != 1 or len(dtypes) != 1
            or len({s.nested for s in states}) != 1):
        return _qkv_one_by_one(_nf4_gemv_linear, attn, x)
    from .kernels.nf4_gemv import NF4Tensors, nf4_linear_group

    weights = [NF4Tensors.from_bnb(m.weight.data, s) for m, s in zip(modules, states)]
    biases = [m.bias for m in modules] if with_bias.pop() else None
    outs = nf4_linear_group(x.to(dtypes.pop()), weights, states[0].code, biases=biases)
    return tuple(out.to(x.dtype) for out in outs)


def _nf4_gemv_add_norm_qkv(unfused: Callable, norm: nn.Module, residual: torch.Tensor, x: torch.Tensor | None,
                           attn: nn.Module):
    """add + RMSNorm + the q/k/v Linear4bit projections in one NF4 GEMV launch (nf4_gemv's
    nf4_add_rms_norm_linear_group) where _nf4_gemv_qkv would take them in one launch, the projections compute
    in the rows' dtype (_compute_dtype: float32 counts as it below DOT_MIN_M rows) and the norm weight is of it,
    up to gemv.NORM_MAX_ROWS rows; otherwise `unfused`."""
    from .kernels.nf4_gemv import NF4Tensors, nf4_add_rms_norm_linear_group

    modules = (attn.q_proj, attn.k_proj, attn.v_proj)
    states = [_gemv_state(m, residual) for m in modules]
    with_bias = {m.bias is not None for m in modules}
    if (residual.shape[0] > gemv.NORM_MAX_ROWS or any(s is None for s in states) or len(with_bias) != 1
            or {_compute_dtype(m, residual) for m in modules} != {residual.dtype}
            or norm.weight.dtype != residual.dtype or len({s.nested for s in states}) != 1):
        return unfused(norm, residual, x, attn)

    weights = [NF4Tensors.from_bnb(m.weight.data, s) for m, s in zip(modules, states)]
    biases = [m.bias for m in modules] if with_bias.pop() else None
    summed, outs = nf4_add_rms_norm_linear_group(residual, x, norm.weight, norm.variance_epsilon, weights,
                                                 states[0].code, biases=biases)
    return summed, tuple(outs)


def _choose_kernels(device: torch.device, dtype: torch.dtype, head_dim: int,
                    kernels: str) -> tuple[dict, str, str]:
    if kernels not in KERNEL_CHOICES:
        raise InvalidArgumentError(f"kernels={kernels!r} is not one of {KERNEL_CHOICES}")
    if kernels == "torch":
        return _REFERENCE, "torch", "requested: plain-torch references"
    dtype_problem = triton_dtype_problem(device, dtype)
    if kernels == "triton":
        if dtype_problem is not None:
            raise InvalidArgumentError(f"kernels='triton': {dtype_problem}")
        if not triton_available(torch.empty(0, device=device)):
            raise InvalidArgumentError(f"kernels='triton' needs Triton on {device.type} (or TRITON_INTERPRET=1)")
        return _FUSED, "triton", "requested: moegraph's Triton kernels"
    if device.type != "cuda":
        return _REFERENCE, "torch", f"plain-torch references on {device.type} (Triton's kernels are for CUDA)"
    if dtype_problem is not None:
        return _REFERENCE, "torch", f"plain-torch references: {dtype_problem}"
    pow2 = head_dim & (head_dim - 1) == 0
    if not triton_available(torch.empty(0, device=device)):
        return _REFERENCE, "torch", "Triton is not importable: plain-torch references"
    if not pow2:
        return _REFERENCE, "torch", f"head_dim {head_dim} is not a power of two: plain-torch references"
    return _FUSED, "triton", "moegraph's fused Triton kernels"


@functools.lru_cache(maxsize=None)
def resolve_ops(device, dtype: torch.dtype, formats: WeightFormats = WeightFormats(), moe_backend: str = "auto",
                head_dim: int = 128, kernels: str = "auto", fuse_norms: bool = True,
                fuse_router_norm: bool | None = None) -> OpTable:
    """The op table for one key; cached, so every caller with the same key shares one decision.
    fuse_norms=False keeps the norms before attention and the router in their own launches (benchmarks);
    fuse_router_norm, where not None, decides the router's apart."""
    device = normalize_device(device)
    small_ops, kernel_name, kernel_why = _choose_kernels(device, dtype, head_dim, kernels)
    backend = describe_moe_backend(device, dtype, moe_backend, formats.experts)
    if formats.projections == LINEAR4BIT and kernel_name == "triton":
        linear, linear_name, linear_why = (_nf4_gemv_linear, "triton", "moegraph's NF4 GEMV for Linear4bit weights "
                                           "(q, k and v in one launch)")
        qkv = _nf4_gemv_qkv
    elif formats.projections == LINEAR4BIT:
        linear, linear_name, linear_why = _module_linear, "bnb", "bitsandbytes Linear4bit forward"
        qkv = functools.partial(_qkv_one_by_one, linear)
    elif kernel_name == "triton":
        linear, linear_name, linear_why = (_dense_gemv_linear, "triton", "moegraph's GEMV where it beats cuBLAS "
                                           f"(q, k and v in one launch up to {gemv.QKV_MAX_ROWS} rows, others up to "
                                           f"{gemv.LINEAR_MAX_ROWS}"
                                           + (f"; on tensor cores up to {gemv.DOT_MAX_ROWS}" if gemv.DOT_MAX_ROWS
                                              else "") + "), torch.nn.functional.linear otherwise")
        qkv = _dense_gemv_qkv
    else:
        linear, linear_name, linear_why = _dense_linear, "torch", "torch.nn.functional.linear"
        qkv = functools.partial(_qkv_one_by_one, linear)
    router_logits = _router_logits_gemv if kernel_name == "triton" else _router_logits_linear
    add_norm_qkv = functools.partial(_add_norm_then_qkv, small_ops["rms_norm"], small_ops["add_rms_norm"], qkv)
    add_norm_router = functools.partial(_add_norm_then_router, small_ops["add_rms_norm"], router_logits)
    fused_qkv = {_dense_gemv_qkv: _dense_gemv_add_norm_qkv, _nf4_gemv_qkv: _nf4_gemv_add_norm_qkv}.get(qkv)
    fuse_router_norm = fuse_norms if fuse_router_norm is None else fuse_router_norm
    fuse_qkv, fuse_router = fuse_norms and fused_qkv is not None, fuse_router_norm and kernel_name == "triton"
    if fuse_qkv:
        add_norm_qkv = functools.partial(fused_qkv, add_norm_qkv)
    if fuse_router:
        add_norm_router = functools.partial(_gemv_add_norm_router, add_norm_router)
    fused_norms = (("; the norm before attention inside the q/k/v GEMV" if fuse_qkv else "")
                   + (f"; the norm before a linear router inside its GEMV (up to {gemv.NORM_MAX_ROWS} rows)"
                      if fuse_router else ""))
    reasons = (
        ("norms", kernel_name, kernel_why + fused_norms),
        ("qk_norm_rope", kernel_name, kernel_why),
        ("attention", kernel_name, "split-KV decode attention over live positions" if kernel_name == "triton"
         else "torch SDPA over the whole cache, masked"),
        ("router", kernel_name, kernel_why + (f"; logits by moegraph's GEMV up to {gemv.ROUTER_MAX_ROWS} rows"
                                              if kernel_name == "triton" else "")),
        ("experts", backend.name, backend.reason),
        ("compiled", "grouped_mm", COMPILED_REASON),
        ("projections", linear_name, linear_why),
    )
    return OpTable(device=device, dtype=dtype, formats=formats, moe_backend=backend.name,
                   capture_safe=backend.capture_safe and device.type == "cuda",
                   experts=expert_function(backend.name, formats.experts), linear=linear, qkv=qkv,
                   add_norm_qkv=add_norm_qkv, add_norm_router=add_norm_router, reasons=reasons,
                   router_logits=router_logits,
                   **small_ops)


def forget_choices() -> None:
    """Drop every cached table and backend probe (after MOEGRAPH_MOE_BACKEND changed, or in tests)."""
    from .moe import select

    resolve_ops.cache_clear()
    select._choose.cache_clear()
    _EXPERTS_OPS.clear()


def experts_format(experts: nn.Module) -> str:
    return getattr(experts, "weight_format", DENSE)


def experts_dtype(experts: nn.Module) -> torch.dtype:
    """The dtype the experts compute in (NF4 experts: what they dequantize to)."""
    return experts.dtype if experts_format(experts) == NF4 else experts.gate_up_proj.dtype


def experts_device(experts: nn.Module) -> torch.device:
    tensor = next(experts.parameters(), None)
    return (tensor if tensor is not None else next(experts.buffers())).device


def _projection_format(model: nn.Module) -> str:
    for module in model.modules():
        if type(module).__name__ == "Linear4bit":
            return LINEAR4BIT
    return DENSE


def _first_experts(model: nn.Module) -> nn.Module | None:
    for module in model.modules():
        experts = getattr(module, "experts", None)
        if experts is not None and hasattr(module, "gate"):
            return experts
    return None


def ops_for_model(model: nn.Module, moe_backend: str = "auto", kernels: str = "auto",
                  fuse_norms: bool | None = None) -> OpTable:
    """The table for a model's decode step, from its device, expert dtype and weight formats. fuse_norms None:
    FUSE_NORMS (what a benchmark's A/B switches for every decoder built after it), or if that is None, fused
    unless the projections are Linear4bit."""
    fuse_norms = FUSE_NORMS if fuse_norms is None else fuse_norms
    config = model.config.get_text_config()  # a vision-language model's decoder config is nested
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    experts = _first_experts(model)
    projections = _projection_format(model)
    if fuse_norms is None:
        fuse_norms = projections != LINEAR4BIT
    if experts is None:
        formats = WeightFormats(DENSE, projections)
        return resolve_ops(model.device, model.dtype, formats, moe_backend, head_dim, kernels, fuse_norms,
                           FUSE_ROUTER_NORM)
    formats = WeightFormats(experts_format(experts), projections)
    return resolve_ops(experts_device(experts), experts_dtype(experts), formats, moe_backend, head_dim, kernels,
                       fuse_norms, FUSE_ROUTER_NORM)


# experts module -> {(moe_backend, device, dtype): its table}: what the registered experts functions read per call
_EXPERTS_OPS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def ops_for_experts(experts: nn.Module, moe_backend: str = "auto") -> OpTable:
    """The table for one experts module (what moegraph's ExpertsInterface functions run in prefill).

    Resolved once per module and key; a module moved to another device or dtype gets the table of its new key."""
    device, dtype = experts_device(experts), experts_dtype(experts)
    tables = _EXPERTS_OPS.get(experts)
    if tables is None:
        tables = _EXPERTS_OPS[experts] = {}
    ops = tables.get((moe_backend, device, dtype))
    if ops is None:
        formats = WeightFormats(experts_format(experts), DENSE)
        ops = tables[(moe_backend, device, dtype)] = resolve_ops(device, dtype, formats, moe_backend)
    return ops
