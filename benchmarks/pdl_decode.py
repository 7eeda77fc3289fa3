"""Decode ms/step with programmatic dependent launch (PDL) off and on, bf16 then NF4 (the same model quantized in
place), full-size Qwen3-30B-A3B layers, graphs on: what letting each Triton kernel start while the one before it
drains buys. Greedy tokens must not change (the kernels compute the same thing in the same order).

    python benchmarks/pdl_decode.py --num-layers 48
"""

import argparse
import os

import torch

from _decode import ab_table, decode, decode_arguments
from moegraph.kernels import _triton
from moegraph.quant.experts import quantize_experts
from moegraph.quant.projections import quantize_projections
from moegraph.testing import build_model


def _set_pdl(on: bool) -> None:
    """MOEGRAPH_PDL is read once per device: clear that reading (the graphs are captured anew by each patch)."""
    os.environ["MOEGRAPH_PDL"] = "1" if on else "0"
    _triton._pdl_on.cache_clear()


def main():
    parser = decode_arguments(argparse.ArgumentParser())
    args = parser.parse_args()
    print(f"PDL supported by this Triton: {_triton._HAVE_GDC}; {torch.cuda.get_device_name()}")
    model = build_model("qwen3-30b-a3b", num_layers=args.num_layers, device="cuda", dtype=torch.bfloat16)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    for weights in ("bf16",) if args.no_nf4 else ("bf16", "nf4"):
        if weights == "nf4":
            quantize_projections(model)
            quantize_experts(model)
            torch.cuda.empty_cache()
        for bs in sizes:
            results = {}
            for on in (False, True):
                _set_pdl(on)
                results[on] = decode(model, bs, args.new_tokens, args.runs)[:2]
            (off_ms, off_tokens), (on_ms, on_tokens) = results[False], results[True]
            rows.append((weights, bs, off_ms, on_ms, torch.equal(off_tokens, on_tokens)))
            print(rows[-1], flush=True)
    print(f"\nlayers={args.num_layers} new_tokens={args.new_tokens} runs={args.runs}")
    print(ab_table(rows, "PDL off", "PDL on"))


if __name__ == "__main__":
    main()
