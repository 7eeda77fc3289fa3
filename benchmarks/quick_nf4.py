"""Quick GPU look, for iteration: moegraph decode ms/step with bf16 experts against NF4 experts (and
Linear4bit projections) on a few full-size Qwen3-30B-A3B layers, the same model quantized in place,
plus the kernels of one NF4 decode step. Final figures come from `python -m moegraph bench --quant nf4`."""

import argparse

import torch

import moegraph
from _decode import decode
from ab_decode import _nf4_shuffle
from moegraph.quant.experts import quantize_experts
from moegraph.quant.projections import quantize_projections
from moegraph.testing import build_model


def decode_ms(model, batch_size, new_tokens):
    ms, _, stats = decode(model, batch_size, new_tokens, runs=1)
    return ms, 1e3 * stats.prefill_seconds, stats.graphs


def kernels_of_one_step(model, label, batch_size=1, top=14):
    moegraph.patch(model, max_batch_size=8)
    try:
        print(label, moegraph.profile_step(model, batch_size).format(top=top))
        print(label, moegraph.profile_step(model, batch_size, graph=True).format(top=top))
    finally:
        moegraph.unpatch(model)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--shuffle", action="store_true",
                        help="also time and profile the NF4 step with every loop on the warp-shuffle lookups")
    args = parser.parse_args()
    model = build_model("qwen3-30b-a3b", num_layers=args.num_layers, device="cuda", dtype=torch.bfloat16)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = [("bf16", bs, *decode_ms(model, bs, args.new_tokens)) for bs in sizes]
    for bs in sizes:
        kernels_of_one_step(model, "bf16", bs)
    dense_gb = torch.cuda.memory_allocated() / 1e9
    quantize_projections(model)
    quantize_experts(model)
    torch.cuda.empty_cache()
    nf4_gb = torch.cuda.memory_allocated() / 1e9
    rows += [("nf4", bs, *decode_ms(model, bs, args.new_tokens)) for bs in sizes]
    for bs in sizes:
        kernels_of_one_step(model, "NF4", bs)
    if args.shuffle:
        _nf4_shuffle(True)
        rows += [("nf4 shf", bs, *decode_ms(model, bs, args.new_tokens)) for bs in sizes]
        for bs in sizes:
            kernels_of_one_step(model, "NF4, shuffle lookups", bs)
        _nf4_shuffle(False)
    print(f"layers={args.num_layers}: memory bf16 {dense_gb:.2f} GB -> NF4 {nf4_gb:.2f} GB")
    print(f"{'weights':>7} {'bs':>3} {'ms/step':>8} {'prefill ms':>10} graphs")
    for name, bs, ms, prefill, graphs in rows:
        print(f"{name:>7} {bs:>3} {ms:8.3f} {prefill:10.1f} {graphs}")


if __name__ == "__main__":
    main()
