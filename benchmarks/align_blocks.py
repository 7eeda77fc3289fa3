"""Expert grouping before the block MoE kernels (kernels/fused_moe.py align_blocks): the "compare" kernel against
the "histogram" kernel, at the pair counts of decode batches 8-64 and of 128-1,024-token prefills (top-8 of 128
experts, Qwen3-30B-A3B's routing), then decode ms/step and the first token of a model grouped each way.

    python benchmarks/align_blocks.py --num-layers 48
"""

import argparse

import torch

import moegraph
from _decode import ab_table, decode, replay_us, same_tokens
from moegraph.kernels import fused_moe
from moegraph.testing import build_model

TOKENS = (8, 16, 32, 64, 128, 512, 1024)


def kernel_table() -> list[str]:
    lines = [f"{'tokens':>6} {'pairs':>5} {'compare us':>10} {'histogram us':>12} {'speedup':>7} same"]
    gen = torch.Generator().manual_seed(0)
    for tokens in TOKENS:
        index = torch.rand(tokens, 128, generator=gen).topk(8, dim=-1).indices.cuda()
        results = {m: fused_moe.align_blocks(index, 128, m) for m in fused_moe.ALIGN_METHODS}
        same = all(torch.equal(a, b) for a, b in zip(*results.values()))
        us = {m: replay_us(lambda m=m: fused_moe.align_blocks(index, 128, m)) for m in fused_moe.ALIGN_METHODS}
        lines.append(f"{tokens:>6} {index.numel():>5} {us['compare']:10.2f} {us['histogram']:12.2f} "
                     f"{us['compare'] / us['histogram']:7.2f} {same}")
    return lines


def first_token_ms(model, prompt_len: int, runs: int = 5) -> float:
    """Median first-token ms (prefill + first pick) of a patched model at batch 1."""
    from moegraph.bench import timed_call

    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len), device="cuda")
    kw = dict(max_new_tokens=1, do_sample=False)
    moegraph.patch(model, max_batch_size=8)
    try:
        model.generate(input_ids=ids, **kw)
        times = sorted(timed_call(lambda: model.generate(input_ids=ids, **kw))[1] for _ in range(runs))
    finally:
        moegraph.unpatch(model)
    return 1e3 * times[len(times) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-layers", type=int, default=48)
    parser.add_argument("--batch-sizes", default="8,32,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    kernels = kernel_table()
    model = build_model("qwen3-30b-a3b", num_layers=args.num_layers, device="cuda", dtype=torch.bfloat16)
    rows, first = [], []
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        results = {}
        for method in fused_moe.ALIGN_METHODS:
            fused_moe.ALIGN_METHOD = method  # read at capture: each patch captures anew
            results[method] = decode(model, bs, args.new_tokens, args.runs)[:2]
        (a_ms, a_tokens), (b_ms, b_tokens) = results["compare"], results["histogram"]
        rows.append(("bf16", bs, a_ms, b_ms, same_tokens(a_tokens, b_tokens)))
        print(rows[-1], flush=True)
    for prompt_len in (128, 512):
        ms = {}
        for method in fused_moe.ALIGN_METHODS:
            fused_moe.ALIGN_METHOD = method
            ms[method] = first_token_ms(model, prompt_len)
        first.append(f"first token, batch 1, {prompt_len} tokens: {ms['compare']:.1f} ms compare, "
                     f"{ms['histogram']:.1f} ms histogram")
    print(f"\n{torch.cuda.get_device_name()} layers={args.num_layers} new_tokens={args.new_tokens} runs={args.runs}")
    print("\n".join(kernels))
    print("\n".join(first))
    print(ab_table(rows, "compare", "histogram"))


if __name__ == "__main__":
    main()
