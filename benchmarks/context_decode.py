"""Decode ms/step against context length and cache capacity, with the split-KV attention kernel and with the
masked SDPA it replaced (the same decoder with only the attention op swapped), in one run.

    python benchmarks/context_decode.py --num-layers 48 --lengths 512,4096,16384,32768

Rows: batch 1 and 8 at each prompt length (fresh cache sized for the call), then the cache-capacity case:
batch 8, 512-token prompts, on a fresh cache and after one call with a long prompt grew it.
"""

import argparse

import torch

import moegraph
from moegraph import ops as ops_module
from moegraph.kernels import decode_attention as attention_kernels
from moegraph.testing import build_model

VARIANTS = {"split-kv": attention_kernels.decode_attention, "sdpa": attention_kernels.decode_attention_ref}


def _prompts(batch, length, vocab, device):
    ids = torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(length)).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _ms_per_step(model, inputs, new_tokens):
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    model.generate(**inputs, **kw)  # capture / warm
    tokens = model.generate(**inputs, **kw)
    stats = moegraph.decode_stats(model)
    return 1e3 * stats.decode_seconds / stats.steps, tokens


def _use(variant):
    ops_module._FUSED["decode_attention"] = VARIANTS[variant]
    ops_module.forget_choices()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-layers", type=int, default=48)
    parser.add_argument("--lengths", default="512,4096,16384,32768")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--grow-to", type=int, default=16384)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="attention ops to run, of " + ",".join(VARIANTS))
    args = parser.parse_args()
    model = build_model("qwen3-30b-a3b", num_layers=args.num_layers, device="cuda", dtype=torch.bfloat16)
    vocab = model.config.vocab_size
    rows, same = [], []
    for variant in args.variants.split(","):
        _use(variant)
        for batch in map(int, args.batch_sizes.split(",")):
            for length in map(int, args.lengths.split(",")):
                if batch * length > 8 * 16384:
                    continue  # the prefill of more tokens than this is the transformers forward's memory, not ours
                moegraph.patch(model, max_batch_size=8)
                ms, tokens = _ms_per_step(model, _prompts(batch, length, vocab, "cuda"), args.new_tokens)
                rows.append((variant, batch, length, "fresh", ms))
                same.append((variant, batch, length, tokens[:, length:].cpu()))
                moegraph.unpatch(model)
                torch.cuda.empty_cache()
        moegraph.patch(model, max_batch_size=8)
        short = _prompts(8, 512, vocab, "cuda")
        rows.append((variant, 8, 512, "fresh", _ms_per_step(model, short, args.new_tokens)[0]))
        model.generate(**_prompts(1, args.grow_to, vocab, "cuda"), max_new_tokens=2)
        rows.append((variant, 8, 512, f"after {args.grow_to}", _ms_per_step(model, short, args.new_tokens)[0]))
        moegraph.unpatch(model)
        torch.cuda.empty_cache()
    print(f"layers={args.num_layers} new_tokens={args.new_tokens} {torch.cuda.get_device_name()}")
    print(f"{'attention':>9} {'bs':>3} {'prompt':>7} {'cache':>12} {'ms/step':>8}")
    for variant, batch, length, cache, ms in rows:
        print(f"{variant:>9} {batch:>3} {length:>7} {cache:>12} {ms:8.2f}")
    first = {(b, n): t for v, b, n, t in same if v == "split-kv"}
    agree = [f"bs{b} {n}: {(first[(b, n)] == t).float().mean().item():.2f}" for v, b, n, t in same if v == "sdpa"]
    print("greedy tokens equal between the two attentions (bf16: near-ties may flip):", ", ".join(agree))


if __name__ == "__main__":
    main()
