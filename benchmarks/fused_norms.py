"""Decode ms/step with the decoder layers' norms in their own launches and fused into the GEMVs after them (the
norm before attention inside the q/k/v GEMV, the norm before the MoE block inside the router's GEMV: two launches
fewer per layer), bf16 then NF4 (the same model quantized in place), full-size Qwen3-30B-A3B layers, graphs on.
Greedy tokens may differ where a near-tie flips: the fused norm sums its squares in another order.

    python benchmarks/fused_norms.py --num-layers 48
"""

import argparse

import torch

import moegraph
from _decode import ab_table, decode, decode_arguments, same_tokens
from moegraph import ops
from moegraph.quant.experts import quantize_experts
from moegraph.quant.projections import quantize_projections
from moegraph.testing import build_model

def _fuse(on: bool) -> None:
    """The decoder's op table with the norms fused (the default) or not; each patch builds its decoder anew."""
    ops.FUSE_NORMS = on


def step_profile(model, batch_size: int, on: bool):
    """(kernels per layer in one eager step, ms of one graph replay)."""
    _fuse(on)
    moegraph.patch(model, max_batch_size=8)
    try:
        profile = moegraph.profile_step(model, batch_size)
    finally:
        moegraph.unpatch(model)
    return profile.kernels_per_layer, profile.graph_replay_ms


def main():
    parser = decode_arguments(argparse.ArgumentParser(), batch_sizes="1,2,4,8")
    args = parser.parse_args()
    model = build_model("qwen3-30b-a3b", num_layers=args.num_layers, device="cuda", dtype=torch.bfloat16)
    print(ops.ops_for_model(model).describe())
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows, kernels = [], []
    for weights in ("bf16",) if args.no_nf4 else ("bf16", "nf4"):
        if weights == "nf4":
            quantize_projections(model)
            quantize_experts(model)
            torch.cuda.empty_cache()
        kernels.append((weights, step_profile(model, 1, False), step_profile(model, 1, True)))
        for bs in sizes:
            results = {}
            for on in (False, True):
                _fuse(on)
                results[on] = decode(model, bs, args.new_tokens, args.runs)[:2]
            (off_ms, off_tokens), (on_ms, on_tokens) = results[False], results[True]
            rows.append((weights, bs, off_ms, on_ms, same_tokens(off_tokens, on_tokens)))
            print(rows[-1], flush=True)
    _fuse(True)
    print(f"\n{torch.cuda.get_device_name()} layers={args.num_layers} new_tokens={args.new_tokens} runs={args.runs}")
    for weights, (off_k, off_ms), (on_k, on_ms) in kernels:
        print(f"{weights}, batch 1: kernels per layer {off_k:.1f} unfused, {on_k:.1f} fused; graph replay "
              f"{off_ms:.3f} ms unfused, {on_ms:.3f} ms fused")
    print(ab_table(rows, "unfused", "fused"))


if __name__ == "__main__":
    main()
