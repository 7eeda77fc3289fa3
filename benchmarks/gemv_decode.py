"""moegraph's decode GEMVs against what they replace, at Qwen3-30B-A3B's shapes (graph replay, so launch gaps
count as they do in the decode graphs), then decode ms/step of the whole model with each of them on and off.

  1. dense GEMV (kernels/gemv.py) tiles against cuBLAS for q/k/v, o_proj, lm_head and the router, 1-8 rows;
  2. per-pair expert GEMVs (kernels/fused_moe.py pair_gemv_experts) tiles against the grouped block kernels;
  3. decode ms/step at batch 1/2/4/8 with each path switched off, and a kernel profile of one batch-1 step.

    python benchmarks/gemv_decode.py --num-layers 48
"""

import argparse
import itertools

import torch

import moegraph
from _decode import replay_us
from moegraph import ops as ops_module
from moegraph.kernels import fused_moe, gemv, moe_combine
from moegraph.testing import build_model, random_prompts

SHAPES = {"qkv": (2048, (4096, 512, 512)), "o": (4096, (2048,)), "lm_head": (2048, (151936,)),
          "router": (2048, (128,))}
GEMV_TILES = [(2, 1024), (4, 1024), (4, 512), (8, 512), (8, 256), (16, 256)]
PAIR_TILES = [(2, 1024), (4, 512), (4, 1024), (8, 256), (8, 512), (16, 256)]
DOT_TILES = [(16, 128), (16, 256), (32, 128), (32, 256), (64, 128)]


def gemv_table():
    print(f"{'shape':>8} {'M':>2} {'baseline us':>11} {'best gemv':>12} {'us':>7} {'TB/s':>6} {'all gemv tiles (us)'}")
    for name, (k, ns) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for n in ns]
        nbytes = sum(w.numel() * 2 for w in weights)
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = torch.cat([torch.nn.functional.linear(x.float(), w.float()) for w in weights], 1)
            got = torch.cat(gemv.linear_gemv_group(x, weights), 1).float()
            assert (got - want).abs().max() < 0.05 * want.abs().max(), name
            base = replay_us(lambda: [torch.nn.functional.linear(x, w) for w in weights])
            tiles = [(t, replay_us(lambda t=t: gemv.linear_gemv_group(x, weights, tile=t))) for t in GEMV_TILES]
            tile, us = min(tiles, key=lambda r: r[1])
            chosen = gemv.tile_for(m, max(ns), k)
            print(f"{name:>8} {m:>2} {base:11.2f} {str(tile):>12} {us:7.2f} {nbytes / us / 1e6:6.2f} "
                  + " ".join(f"{t[0]}x{t[1]}{'*' if t == chosen else ''}:{u:.1f}" for t, u in tiles))
        for m in (4, 8, 16):  # the tensor-core form (use_dot), tiles x warps
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = replay_us(lambda: [torch.nn.functional.linear(x, w) for w in weights])
            cells = []
            for tile, warps in itertools.product(DOT_TILES, (2, 4)):
                us = replay_us(lambda: gemv.linear_gemv_group(x, weights, tile=tile, num_warps=warps, use_dot=True))
                cells.append((us, f"{tile[0]}x{tile[1]}/{warps}{'*' if tile == gemv.DOT_TILE else ''}:{us:.1f}"))
            best = min(cells)[0]
            print(f"{name + ' dot':>8} {m:>2} {base:11.2f} {'':>12} {best:7.2f} {nbytes / best / 1e6:6.2f} "
                  + " ".join(c for _, c in cells))


def experts_table():
    experts, hidden, inter, top_k = 128, 2048, 768, 8
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    down = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    print(f"\n{'T':>2} {'distinct':>8} {'blocks us':>9} {'best pair':>10} {'us':>7} {'TB/s':>6} {'all pair tiles (us)'}")
    for tokens in (1, 2, 4, 8):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        weights, index = torch.rand(tokens, experts, device="cuda").softmax(-1).topk(top_k, dim=-1)
        weights = weights.to(torch.bfloat16)
        distinct = index.unique().numel()
        nbytes = distinct * 3 * hidden * inter * 2
        keep = fused_moe.PAIR_GEMV_MAX_TOKENS
        fused_moe.PAIR_GEMV_MAX_TOKENS = 0
        blocks = replay_us(lambda: fused_moe.fused_moe_experts(x, index, weights, gate_up, down,
                                                                moe_combine.moe_combine))
        fused_moe.PAIR_GEMV_MAX_TOKENS = keep
        ref = fused_moe.fused_moe_experts_ref(x, index, weights, gate_up, down).float()

        def pair(tile):
            out = fused_moe.pair_gemv_experts(x, index, gate_up, down, *tile)
            return moe_combine.moe_combine(out, None, weights, x.dtype)

        assert ((pair(PAIR_TILES[0]).float() - ref).norm() / ref.norm()) < 1e-2
        tiles = [(t, replay_us(lambda t=t: pair(t))) for t in PAIR_TILES]
        tile, us = min(tiles, key=lambda r: r[1])
        chosen = (fused_moe.PAIR_BLOCK_N, fused_moe.PAIR_BLOCK_K)
        print(f"{tokens:>2} {distinct:>8} {blocks:9.2f} {str(tile):>10} {us:7.2f} {nbytes / us / 1e6:6.2f} "
              + " ".join(f"{t[0]}x{t[1]}{'*' if t == chosen else ''}:{u:.1f}" for t, u in tiles))
        print(f"{'':>2} {'':>8} blocks at {nbytes / blocks / 1e6:.2f} TB/s")


def sweep_table():
    """Tiles x num_warps at one and two rows / tokens: each kernel on its own."""
    experts, hidden, inter, top_k = 128, 2048, 768, 8
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    down = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    weights = [torch.randn(n, 2048, device="cuda", dtype=torch.bfloat16) for n in (4096, 512, 512)]
    o_weight = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    print("\nsweep (us): tile/warps")
    for tokens in (1, 2):
        index = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=-1).indices
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        xo = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
        for label, fn in (("pairs", lambda t, w: fused_moe.pair_gemv_experts(x, index, gate_up, down, *t, num_warps=w)),
                          ("qkv", lambda t, w: gemv.linear_gemv_group(x, weights, tile=t, num_warps=w)),
                          ("o", lambda t, w: gemv.linear_gemv_group(xo, [o_weight], tile=t, num_warps=w))):
            cells = []
            for tile in ((2, 1024), (4, 1024), (8, 1024), (2, 2048), (4, 2048), (1, 2048)):
                for warps in (2, 4, 8):
                    cells.append(f"{tile[0]}x{tile[1]}/{warps}:{replay_us(lambda: fn(tile, warps)):.1f}")
            print(f"{label:>6} T={tokens} " + " ".join(cells))


def decode_table(num_layers):
    model = build_model("qwen3-30b-a3b", num_layers=num_layers, device="cuda", dtype=torch.bfloat16)
    rows = []
    keep_rows, keep_tokens = gemv.MAX_ROWS, fused_moe.PAIR_GEMV_MAX_TOKENS
    for use_gemv, use_pairs in itertools.product((False, True), (False, True)):
        gemv.MAX_ROWS = keep_rows if use_gemv else 0
        fused_moe.PAIR_GEMV_MAX_TOKENS = keep_tokens if use_pairs else 0
        ops_module.forget_choices()
        for bs in (1, 2, 4, 8):
            moegraph.patch(model, max_batch_size=8)
            inputs = random_prompts(bs, vocab_size=model.config.vocab_size, min_len=100, max_len=128, device="cuda")
            kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False)
            model.generate(**inputs, **kw)
            model.generate(**inputs, **kw)
            st = moegraph.decode_stats(model)
            rows.append((use_gemv, use_pairs, bs, 1e3 * st.decode_seconds / st.steps))
            if bs == 1 and use_gemv and use_pairs:
                print(moegraph.profile_step(model, 1).format(top=16))
            moegraph.unpatch(model)
    gemv.MAX_ROWS, fused_moe.PAIR_GEMV_MAX_TOKENS = keep_rows, keep_tokens
    print(f"layers={num_layers}\n{'gemv':>5} {'pairs':>5} {'bs':>3} {'ms/step':>8} {'tok/s':>8}")
    for use_gemv, use_pairs, bs, ms in rows:
        print(f"{use_gemv!s:>5} {use_pairs!s:>5} {bs:>3} {ms:8.3f} {1e3 * bs / ms:8.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-layers", type=int, default=48)
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--sweep-only", action="store_true")
    args = parser.parse_args()
    if args.sweep_only:
        sweep_table()
        raise SystemExit
    if not args.skip_kernels:
        gemv_table()
        experts_table()
    decode_table(args.num_layers)
