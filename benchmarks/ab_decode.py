"""Decode ms/step with each switch that waits on a GPU timing off and on, one at a time, then all of them on:
full-size Qwen3-30B-A3B layers, graphs on, bf16 then NF4 (the same model quantized in place). A switch's
default changes only after this has timed it.

    python benchmarks/ab_decode.py --num-layers 48
    python benchmarks/ab_decode.py --num-layers 12 --switches pair_combine,nf4_x_pairs --batch-sizes 1

Switches (each a module-level choice that a new patch's captures read):
- fuse_norms: the norms before attention and the router inside the GEMVs after them (ops.FUSE_NORMS; by default
  fused for dense projections, not for Linear4bit ones);
- pair_combine: the pair path's down GEMVs and the weighted combine in one launch (fused_moe.PAIR_COMBINE, and
  nf4_moe.PAIR_COMBINE for the NF4 multiply-add path);
- gemv_dot: dense q/k/v (with its norm) and o_proj at 5-16 rows through the GEMV's tensor-core form instead of
  cuBLAS (gemv.DOT_MAX_ROWS);
- one_warp: the router's softmax top-k and the q/k norm + RoPE kernels in one warp a program instead of Triton's
  default 4 (router_topk.ROUTER_WARPS, qk_norm_rope.NUM_WARPS);
- align_histogram: the histogram grouping kernel instead of the compare one (fused_moe.ALIGN_METHOD);
- nf4_x_pairs: the NF4 multiply-add loop (where it does not take LOOKUP 5) with x read as pairs in the weight
  tile's layout (nf4_moe, nf4_gemv X_PAIRS); NF4 rows only;
- nf4_shuffle (on by default since 2026-12-06): every NF4 loop's code table read by warp shuffles, a 32-bit word
  of weights at a time where it can (LOOKUP 5, else 4); off: the shared-memory table (1; 3 at 2-15 tokens). NF4
  rows only;
- nf4_moe_words / nf4_few_words / nf4_gemv_words: one part of nf4_shuffle alone: the one-token experts, the
  2-15-token experts, the NF4 GEMVs;
- fuse_router_norm: the router's norm inside its GEMV (on) or apart (off), whatever the norm before attention does
  (ops.FUSE_ROUTER_NORM; by default as that one: with 4-bit projections both apart);
- attn_short_chunks: decode attention splits a row's keys into chunks of 64 or more (on) rather than 256
  (decode_attention.MIN_CHUNK): a 128-key row runs in 2 programs per KV head, not 1;
- nf4_one_token_w8 (on by default since 2026-12-07): the one-token NF4 expert kernels in 8 warps a program (on)
  rather than 4 (nf4_moe.ONE_TOKEN_NUM_WARPS); NF4 rows only;
- nf4_wide_steps (on by default since 2026-12-07): one-row NF4 GEMVs of 4096 or more outputs (q; q/k/v in one
  launch) in 16-row tiles of 2048 columns a step (on) rather than 1024 (nf4_gemv.WIDE_TILE); NF4 rows only;
- early_weights (on by default since 2026-12-07): under PDL the NF4 words loops load their first weight step
  before waiting for the kernel before them (the GEMVs always; the one-to-15-token down kernel with the late
  trigger, its routing too); NF4 rows only;
- nf4_one_token_gu1024 / nf4_one_token_gu2048: the one-token NF4 gate_up's 2048-long rows in 1024- or 2048-wide
  steps (on) rather than 512 (nf4_moe.ONE_TOKEN_BLOCK_K); NF4 rows only;
- nf4_dot_stages2 / nf4_dot_stages1: the NF4 tensor-core path (16+ tokens) with 2 or 1 pipelining stages (on)
  rather than Triton's default (nf4_moe.DOT_NUM_STAGES): less shared memory a program, more programs an SM; NF4
  rows only, the same bits;
- pdl_late_trigger: a graph's kernel lets the next one launch only once its own wait is over (on), or at its start
  (off), whatever the decoder would choose (_triton.PDL_EARLY_TRIGGER; ops.OpTable.pdl_early_trigger).
Tokens are compared with the switch off: fused norms, tensor cores, one warp's reduction order and grouping may
flip a near-tie (another summation order); pair_combine and x_pairs give the same bits; shuffle sums a word of 8
products first (another order).
"""

import argparse

import torch

from _decode import ab_table, decode, decode_arguments, same_tokens
from moegraph import ops
from moegraph.kernels import _triton, decode_attention, fused_moe, gemv, nf4_gemv, nf4_moe, qk_norm_rope, router_topk
from moegraph.quant.experts import quantize_experts
from moegraph.quant.projections import quantize_projections
from moegraph.testing import build_model

def _fuse_norms(on) -> None:
    ops.FUSE_NORMS = on  # None: by the projections' format


def _fuse_router_norm(on) -> None:
    ops.FUSE_ROUTER_NORM = on  # None: as the norm before attention


def _attn_short_chunks(on: bool) -> None:
    decode_attention.MIN_CHUNK = 64 if on else 256


def _pair_combine(on: bool) -> None:
    fused_moe.PAIR_COMBINE = nf4_moe.PAIR_COMBINE = on


def _gemv_dot(on: bool) -> None:
    gemv.DOT_MAX_ROWS = gemv.DOT_ROWS_LIMIT if on else 0


def _one_warp(on: bool) -> None:
    router_topk.ROUTER_WARPS = qk_norm_rope.NUM_WARPS = 1 if on else 4


def _align_histogram(on: bool) -> None:
    fused_moe.ALIGN_METHOD = "histogram" if on else "compare"


def _nf4_x_pairs(on: bool) -> None:
    nf4_moe.X_PAIRS = nf4_gemv.X_PAIRS = on


def _nf4_moe_words(on: bool) -> None:
    nf4_moe.LOOKUP = 5 if on else 1


def _nf4_few_words(on: bool) -> None:
    nf4_moe.FEW_TOKENS_LOOKUP = 5 if on else 3


def _nf4_gemv_words(on: bool) -> None:
    nf4_gemv.LOOKUP = 5 if on else 1


def _nf4_shuffle(on: bool) -> None:
    """Every NF4 loop on the warp-shuffle lookups (the default): a 32-bit word of weights at a time (LOOKUP 5) where
    x is 16-bit and no norm runs in front, per nibble (4) elsewhere. Off: the defaults before them (1; 3 at 2-15
    tokens)."""
    _nf4_moe_words(on)
    _nf4_few_words(on)
    _nf4_gemv_words(on)


def _nf4_one_token_w8(on: bool) -> None:
    nf4_moe.ONE_TOKEN_NUM_WARPS = 8 if on else 4


def _nf4_wide_steps(on: bool) -> None:
    nf4_gemv.WIDE_TILE = (16, 2048) if on else (16, 1024)


def _early_weights(on: bool) -> None:
    nf4_moe.WEIGHTS_BEFORE_WAIT = nf4_gemv.WEIGHTS_BEFORE_WAIT = on


def _nf4_shared_x(on: bool) -> None:
    nf4_moe.SHARED_X = on


def _nf4_one_token_k512(on: bool) -> None:
    nf4_moe.ONE_TOKEN_BLOCK_K = (512, 256) if on else (256, 256)


def _nf4_one_token_gu(width: int):
    def switch(on: bool) -> None:
        nf4_moe.ONE_TOKEN_BLOCK_K = (width, 256) if on else (512, 256)
    return switch


def _nf4_dot_stages(stages: int):
    def switch(on: bool) -> None:
        nf4_moe.DOT_NUM_STAGES = stages if on else None
    return switch


def _nf4_few_16_32(on: bool) -> None:
    nf4_moe.FEW_TOKENS_BLOCK_N = (16, 32) if on else (8, 16)


def _pdl_late_trigger(on) -> None:
    _triton.PDL_EARLY_TRIGGER = None if on is None else not on  # None: each decoder's choice


# name -> (setter, default state, NF4 rows only)
SWITCHES = {"fuse_norms": (_fuse_norms, None, False), "pair_combine": (_pair_combine, False, False),
            "gemv_dot": (_gemv_dot, False, False), "one_warp": (_one_warp, True, False),
            "align_histogram": (_align_histogram, False, False), "nf4_x_pairs": (_nf4_x_pairs, False, True),
            "nf4_shuffle": (_nf4_shuffle, True, True), "nf4_moe_words": (_nf4_moe_words, True, True),
            "nf4_few_words": (_nf4_few_words, True, True), "nf4_gemv_words": (_nf4_gemv_words, True, True),
            "pdl_late_trigger": (_pdl_late_trigger, None, False),
            "fuse_router_norm": (_fuse_router_norm, None, False), "attn_short_chunks": (_attn_short_chunks, True, False),
            "nf4_one_token_w8": (_nf4_one_token_w8, True, True),
            "nf4_wide_steps": (_nf4_wide_steps, True, True),
            "early_weights": (_early_weights, True, True), "nf4_shared_x": (_nf4_shared_x, True, True),
            "nf4_one_token_k512": (_nf4_one_token_k512, True, True), "nf4_few_16_32": (_nf4_few_16_32, True, True),
            "nf4_one_token_gu1024": (_nf4_one_token_gu(1024), False, True),
            "nf4_one_token_gu2048": (_nf4_one_token_gu(2048), False, True),
            "nf4_dot_stages2": (_nf4_dot_stages(2), False, True), "nf4_dot_stages1": (_nf4_dot_stages(1), False, True)}


def _set_all(names, on: bool) -> None:
    for name in names:
        SWITCHES[name][0](on)


def main():
    parser = decode_arguments(argparse.ArgumentParser())
    parser.add_argument("--switches", default=",".join(SWITCHES),
                        help="comma-separated; a+b: a row with both on together")
    args = parser.parse_args()
    entries = [entry.split("+") for entry in args.switches.split(",")]
    names = list(dict.fromkeys(name for entry in entries for name in entry))
    unknown = set(names) - set(SWITCHES)
    if unknown:
        parser.error(f"unknown switches {sorted(unknown)}; known: {', '.join(SWITCHES)}")
    model = build_model("qwen3-30b-a3b", num_layers=args.num_layers, device="cuda", dtype=torch.bfloat16)
    print(ops.ops_for_model(model).describe())
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    tables = {}
    for weights in ("bf16",) if args.no_nf4 else ("bf16", "nf4"):
        if weights == "nf4":
            quantize_projections(model)
            quantize_experts(model)
            torch.cuda.empty_cache()
        used = [n for n in names if weights == "nf4" or not SWITCHES[n][2]]
        if not used:  # only NF4 switches asked for: no bf16 rows
            continue
        rows_here = [("+".join(e), e) for e in entries if all(n in used for n in e)]
        for label, switched in rows_here + ([("all", used)] if len(used) > 1 else []):
            rows = tables.setdefault(label, [])
            for bs in sizes:
                results = {}
                for on in (False, True):
                    _set_all(used, False)
                    _set_all(switched, on)
                    results[on] = decode(model, bs, args.new_tokens, args.runs)[:2]
                (off_ms, off_tokens), (on_ms, on_tokens) = results[False], results[True]
                rows.append((weights, bs, off_ms, on_ms, same_tokens(off_tokens, on_tokens)))
                print(label, rows[-1], flush=True)
    for name in SWITCHES:  # back to the defaults
        SWITCHES[name][0](SWITCHES[name][1])
    print(f"\n{torch.cuda.get_device_name()} layers={args.num_layers} new_tokens={args.new_tokens} runs={args.runs}")
    for label, rows in tables.items():
        print(f"\n{label} (off: every listed switch off; all: every one on)" if label == "all" else f"\n{label}")
        print(ab_table(rows, "off", "on"))


if __name__ == "__main__":
    main()
