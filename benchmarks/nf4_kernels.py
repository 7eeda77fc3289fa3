"""NF4 decode kernels on one GPU: correctness against their _ref, CUDA-graph replay, and bandwidth per tile config.

    python benchmarks/nf4_kernels.py            # ~2 minutes on an H200 (most of it Triton compiles)

1. copy bandwidth (read + write of a 1 GiB buffer), the roofline every row is measured against;
2. nf4_linear at the attention-projection shapes (K -> N: 2048 -> 4096, 2048 -> 512, 4096 -> 2048) and
   fused_moe_experts_nf4 at Qwen3-30B-A3B's (E 128, H 2048, I 768, top-8), M = 1 and 8 rows, each config
   checked against the reference (relative L2 error, fresh random data) and timed inside a CUDA graph (as
   decode runs them: no host overhead) that replays back-to-back calls rotating over enough weight copies /
   expert sets (>= 5x the 50 MB L2) that L2 cannot serve them; the bf16 fused_moe_experts at the same shapes;
3. a CUDA-graph capture of each kernel, replayed: must equal the eager call bit for bit.
Bytes counted: 0.5 B per weight read + its absmax (4 B, or 1 B nested, per 64) + activations in and out.
The table comes last. Inputs are built here (random bytes, positive absmax); nothing is downloaded.
"""

import argparse
import math
import time

import torch
import triton
from triton.testing import do_bench

from moegraph.kernels.fused_moe import fused_moe_experts
from moegraph.kernels.moe_combine import moe_combine
from moegraph.kernels.nf4_gemv import NF4LinearConfig, nf4_linear, nf4_linear_ref
from moegraph.kernels.nf4_moe import (NF4MoEConfig, NF4Tensors, fused_moe_experts_nf4, fused_moe_experts_nf4_ref,
                                      nf4_code)

DEVICE = "cuda"
DTYPE = torch.bfloat16
ROTATE_BYTES = 256 << 20  # weight bytes cycled through per timed graph: 5x the H200's 50 MB L2
MAX_COPIES = 256  # calls per timed graph (the smallest weight, 0.56 MB, needs 256 copies for ROTATE_BYTES)
LINEAR_SHAPES = [(2048, 4096), (2048, 512), (4096, 2048)]  # (K, N): q (and o's transpose), k / v, o
MOE = dict(experts=128, hidden=2048, inter=768, top_k=8)
ROWS = [1, 8]
L = NF4LinearConfig
LINEAR_CONFIGS = {  # "auto": the launcher's choice; use_dot=False forms are timed at M = 1 only (M >= 2: tensor cores)
    "auto": L(),
    "fma bn16 bk256 w4": L(use_dot=False, block_n=16, num_warps=4),
    "fma bn8 bk256 w4": L(use_dot=False, block_n=8, num_warps=4),
    "fma bn8 bk512 w4": L(use_dot=False, block_n=8, block_k=512, num_warps=4),
    "fma bn16 bk512 w4": L(use_dot=False, block_n=16, block_k=512, num_warps=4),
    "fma bn16 bk1024 w4": L(use_dot=False, block_n=16, block_k=1024, num_warps=4),
    "fma bn16 bk1024 w8": L(use_dot=False, block_n=16, block_k=1024, num_warps=8),
    "fma bn8 bk1024 w4": L(use_dot=False, block_n=8, block_k=1024, num_warps=4),
    "fma bn32 bk1024 w8": L(use_dot=False, block_n=32, block_k=1024, num_warps=8),
    "fma bn16 bk1024 w4 split1": L(use_dot=False, block_n=16, block_k=1024, num_warps=4, split_k=1),
    "fma bn8 bk2048 w4 split1": L(use_dot=False, block_n=8, block_k=2048, num_warps=4, split_k=1),
    # fewer shared-memory barriers a step (tools/sass_report.py): both nibbles in one gather, x read as pairs
    "auto lookup3 pairs": L(lookup=3, x_pairs=True),
    "fma bn8 bk2048 w4 lookup3 pairs": L(use_dot=False, block_n=8, block_k=2048, num_warps=4, lookup=3, x_pairs=True),
    "fma bn4 bk2048 w2 lookup3 pairs": L(use_dot=False, block_n=4, block_k=2048, num_warps=2, lookup=3, x_pairs=True),
    "fma bn2 bk2048 w1 lookup3 pairs": L(use_dot=False, block_n=2, block_k=2048, num_warps=1, lookup=3, x_pairs=True),
    # the code table read by warp shuffles: no shared memory in the loop
    "auto lookup4": L(lookup=4),
    "auto lookup4 pairs": L(lookup=4, x_pairs=True),
    "auto lookup5": L(lookup=5),  # a 32-bit word of weights a time
    "auto shared": L(shared_x=True),  # rows 2i and 2i + 1 a thread against one x load (slower: SHARED_X off)
    # the words lookup (the default since 2026-12-06) in other tiles, and the shared-memory table it replaced
    "auto lookup1": L(lookup=1),
    "w5 bn8 bk1024 w4": L(use_dot=False, block_n=8, block_k=1024, num_warps=4),
    "w5 bn16 bk2048 w4": L(use_dot=False, block_n=16, block_k=2048, num_warps=4),
    "w5 bn4 bk2048 w2": L(use_dot=False, block_n=4, block_k=2048, num_warps=2),
    "w5 bn8 bk512 w4": L(use_dot=False, block_n=8, block_k=512, num_warps=4),
    "w5 bn16 bk512 w2": L(use_dot=False, block_n=16, block_k=512, num_warps=2),
    "w5 bn32 bk1024 w8": L(use_dot=False, block_n=32, block_k=1024, num_warps=8),
    "w5 bn4 bk1024 w2": L(use_dot=False, block_n=4, block_k=1024, num_warps=2),
    "w5 bn8 bk2048 w2": L(use_dot=False, block_n=8, block_k=2048, num_warps=2),
    "w5 bn8 bk2048 w8": L(use_dot=False, block_n=8, block_k=2048, num_warps=8),
    "w5 bn16 bk1024 w8": L(use_dot=False, block_n=16, block_k=1024, num_warps=8),
}
def C(**choices) -> NF4MoEConfig:  # a name without "bk" or "gu" has 256-wide steps at every token count
    return NF4MoEConfig(**dict(dict(block_k=256), **choices))


MOE_CONFIGS = {  # gate_up / down block_n, block_k (>= 512: each step summed at once), warps
    "auto": NF4MoEConfig(),
    "fma 8/16 bk256 w4": C(use_dot=False, gate_up_block_n=8, down_block_n=16, num_warps=4),
    "fma 16/32 bk512 w4": C(use_dot=False, gate_up_block_n=16, down_block_n=32, block_k=512, num_warps=4),
    "fma 8/16 bk512 w4": C(use_dot=False, gate_up_block_n=8, down_block_n=16, block_k=512, num_warps=4),
    "fma 16/32 bk1024 w4": C(use_dot=False, gate_up_block_n=16, down_block_n=32, block_k=1024, num_warps=4),
    "fma 16/32 bk1024 w8": C(use_dot=False, gate_up_block_n=16, down_block_n=32, block_k=1024, num_warps=8),
    "fma 8/16 bk1024 w4": C(use_dot=False, gate_up_block_n=8, down_block_n=16, block_k=1024, num_warps=4),
    "fma 8/8 bk1024 w2": C(use_dot=False, gate_up_block_n=8, down_block_n=8, block_k=1024, num_warps=2),
    "fma 16/16 bk1024 w4": C(use_dot=False, gate_up_block_n=16, down_block_n=16, block_k=1024, num_warps=4),
    "fma 8/16 bk2048 w4": C(use_dot=False, gate_up_block_n=8, down_block_n=16, block_k=2048, num_warps=4),
    "fma lookup3": C(use_dot=False, lookup=3),
    "fma pairs": C(use_dot=False, x_pairs=True),
    "fma lookup3 pairs": C(use_dot=False, lookup=3, x_pairs=True),
    "fma 8/16 bk512 w4 lookup3 pairs": C(use_dot=False, gate_up_block_n=8, down_block_n=16, block_k=512, num_warps=4,
                                         lookup=3, x_pairs=True),
    # thin tiles, the whole row in one step, as the dense pair GEMV (kernels/fused_moe.py: 2 x 2048, 2 warps)
    "fma 4/4 bk2048 w2 lookup3 pairs": C(use_dot=False, gate_up_block_n=4, down_block_n=4, block_k=2048, num_warps=2,
                                         lookup=3, x_pairs=True),
    "fma 2/2 bk2048 w1 lookup3 pairs": C(use_dot=False, gate_up_block_n=2, down_block_n=2, block_k=2048, num_warps=1,
                                         lookup=3, x_pairs=True),
    "fma 4/4 bk1024 w2 pairs": C(use_dot=False, gate_up_block_n=4, down_block_n=4, block_k=1024, num_warps=2,
                                 x_pairs=True),
    "fma lookup3 pairs combine": C(use_dot=False, lookup=3, x_pairs=True, combine=True),
    "fma lookup4": C(use_dot=False, lookup=4),
    "fma lookup4 pairs": C(use_dot=False, lookup=4, x_pairs=True),
    "dot lookup4": C(use_dot=True, lookup=4),
    # fewer pipelining stages: less shared memory a program, more programs an SM (time at --rows 32,64)
    "dot s2": C(use_dot=True, num_stages=2),
    "dot s1": C(use_dot=True, num_stages=1),
    "fma lookup5": C(use_dot=False, lookup=5),
    # the words lookup (the default since 2026-12-06) in other tiles, and the tables it replaced
    "fma lookup1": C(use_dot=False, lookup=1),
    "w5 8/16 bk256 w4": C(use_dot=False, gate_up_block_n=8, down_block_n=16, num_warps=4),
    "w5 8/16 bk512 w4": C(use_dot=False, gate_up_block_n=8, down_block_n=16, block_k=512, num_warps=4),
    "w5 16/32 bk512 w4": C(use_dot=False, gate_up_block_n=16, down_block_n=32, block_k=512, num_warps=4),
    "w5 4/8 bk512 w2": C(use_dot=False, gate_up_block_n=4, down_block_n=8, block_k=512, num_warps=2),
    "w5 16/32 bk256 w8": C(use_dot=False, gate_up_block_n=16, down_block_n=32, num_warps=8),
    "w5 16/32 bk256 w4": C(use_dot=False, gate_up_block_n=16, down_block_n=32, num_warps=4),
    "w5 8/16 bk256 w8": C(use_dot=False, gate_up_block_n=8, down_block_n=16, num_warps=8),
    # each thread two words against one x load (SHARED_X, the default since 2026-12-07) or one; gate_up's 2048-long
    # rows in wider steps than down's 768-long ones
    "w5 8/16 bk256 w8 alone": C(use_dot=False, gate_up_block_n=8, down_block_n=16, num_warps=8, shared_x=False),
    "w5 8/16 gu512 dn256 w8": C(use_dot=False, gate_up_block_n=8, down_block_n=16, block_k=512, down_block_k=256,
                                num_warps=8),
    "w5 8/16 gu512 dn256 w4": C(use_dot=False, gate_up_block_n=8, down_block_n=16, block_k=512, down_block_k=256,
                                num_warps=4),
    "w5 8/32 bk256 w8": C(use_dot=False, gate_up_block_n=8, down_block_n=32, num_warps=8),
    "w5 8/32 gu512 dn256 w8": C(use_dot=False, gate_up_block_n=8, down_block_n=32, block_k=512, down_block_k=256,
                                num_warps=8),
    # fewer steps a program at one token (each a round trip to DRAM): gate_up's rows in 2 or 1, down's in 1 (768 of
    # 1024 columns live)
    "w5 8/16 gu1024 dn256 w8": C(use_dot=False, gate_up_block_n=8, down_block_n=16, block_k=1024, down_block_k=256,
                                 num_warps=8),
    "w5 8/16 gu2048 dn256 w8": C(use_dot=False, gate_up_block_n=8, down_block_n=16, block_k=2048, down_block_k=256,
                                 num_warps=8),
    "w5 4/16 gu2048 dn256 w4": C(use_dot=False, gate_up_block_n=4, down_block_n=16, block_k=2048, down_block_k=256,
                                 num_warps=4),
    "w5 8/16 gu512 dn1024 w8": C(use_dot=False, gate_up_block_n=8, down_block_n=16, block_k=512, down_block_k=1024,
                                 num_warps=8),
    "w5 16/32 gu512 dn256 w8": C(use_dot=False, gate_up_block_n=16, down_block_n=32, block_k=512, down_block_k=256,
                                 num_warps=8),
    "w5 16/32 bk256 w8 alone": C(use_dot=False, gate_up_block_n=16, down_block_n=32, num_warps=8, shared_x=False),
    # wider steps, more of each thread's bytes in flight: slower at 1 and 8 tokens (H100, 2026-12-07)
    "w5 8/16 bk512 w8": C(use_dot=False, gate_up_block_n=8, down_block_n=16, block_k=512, num_warps=8),
    "w5 8/16 bk1024 w4": C(use_dot=False, gate_up_block_n=8, down_block_n=16, block_k=1024, num_warps=4),
    "w5 8/16 bk1024 w8": C(use_dot=False, gate_up_block_n=8, down_block_n=16, block_k=1024, num_warps=8),
    "w5 4/8 bk1024 w4": C(use_dot=False, gate_up_block_n=4, down_block_n=8, block_k=1024, num_warps=4),
    "w5 4/8 bk512 w4": C(use_dot=False, gate_up_block_n=4, down_block_n=8, block_k=512, num_warps=4),
    "w5 8/8 bk512 w4": C(use_dot=False, gate_up_block_n=8, down_block_n=8, block_k=512, num_warps=4),
    # the down GEMVs and the weighted combine in one launch, on thin tiles (more programs for one token's rows)
    "w5 8/4 bk256 w2 combine": C(use_dot=False, gate_up_block_n=8, down_block_n=4, num_warps=2, combine=True),
    "w5 8/8 bk256 w4 combine": C(use_dot=False, gate_up_block_n=8, down_block_n=8, num_warps=4, combine=True),
    "w5 32/64 bk256 w8": C(use_dot=False, gate_up_block_n=32, down_block_n=64, num_warps=8),
    "w5 16/32 bk1024 w4": C(use_dot=False, gate_up_block_n=16, down_block_n=32, block_k=1024, num_warps=4),
    "w5 8/8 bk1024 w2": C(use_dot=False, gate_up_block_n=8, down_block_n=8, block_k=1024, num_warps=2),
    # tensor cores (each expert dequantized once per step, not once per pair) below DOT_MIN_TOKENS too
    "dot lookup3": C(use_dot=True, lookup=3),
    # 8 warps: the gate_up tile's registers without spills (4 warps: 122 spill instructions, tools/sass_report.py)
    "dot 64/64 w8 lookup3": C(use_dot=True, gate_up_block_n=64, down_block_n=64, num_warps=8, lookup=3),
}


def random_nf4(experts, rows, cols, nested, gen):
    """Random bytes and positive absmax (weights ~0.02, like a trained layer's); (N, K) when experts is None."""
    e = experts or 1
    nblocks = rows * cols // 64
    packed = torch.randint(0, 256, (e, rows * cols // 2), dtype=torch.uint8, device=DEVICE, generator=gen)
    shape = (rows, cols) if experts is None else (e, rows, cols)
    if not nested:
        absmax = torch.rand(e, nblocks, device=DEVICE, generator=gen) * 0.03 + 0.01
        return NF4Tensors(packed, absmax, shape)
    absmax_q = torch.randint(0, 256, (e, nblocks), dtype=torch.uint8, device=DEVICE, generator=gen)
    nested_code = torch.rand(256, device=DEVICE, generator=gen) * 2 - 1
    nested_absmax = torch.rand(e, -(-nblocks // 256), device=DEVICE, generator=gen) * 0.01 + 0.005
    offset = torch.full((e,), 0.02, device=DEVICE)
    return NF4Tensors(packed, absmax_q, shape, nested_code, nested_absmax, offset)


def nf4_bytes(rows, cols, nested):
    return rows * cols // 2 + rows * cols // 64 * (1 if nested else 4)


def rel_err(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def time_us(fn):
    return do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3


def graph_us(calls, replays=3):
    """Mean time of one call: `calls` (distinct inputs, each already run once) captured back to back in a graph."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) * 1e3 / (replays * len(calls))


def copy_bandwidth():
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (time_us(lambda: dst.copy_(src)) * 1e-6)


def bench_linear(rows_out, copy_bw, gen):
    for k, n in LINEAR_SHAPES:
        for nested in (False, True):
            copies = max(2, min(MAX_COPIES, ROTATE_BYTES // nf4_bytes(n, k, nested)))
            weights = [random_nf4(None, n, k, nested, gen) for _ in range(copies)]
            code = nf4_code(DEVICE)
            extra = lambda w: dict(nested_code=w.nested_code, nested_absmax=w.nested_absmax, offset=w.offset)  # noqa
            for m in ROWS:
                x = torch.randn(m, k, device=DEVICE, generator=gen).to(DTYPE)
                w0 = weights[0]
                want = nf4_linear_ref(x, w0.packed, w0.absmax, code, n, k, **extra(w0))
                moved = nf4_bytes(n, k, nested) + 2 * m * (k + n)
                configs = LINEAR_CONFIGS if not nested else dict([next(iter(LINEAR_CONFIGS.items()))])
                for name, cfg in configs.items():
                    if m > 1 and cfg.use_dot is False:  # multiply-add forms: timed at one row
                        continue
                    run = lambda w, cfg=cfg: nf4_linear(x, w.packed, w.absmax, code, n, k, config=cfg, **extra(w))  # noqa
                    try:
                        err = rel_err(run(w0), want)
                        us = graph_us([lambda w=w: run(w) for w in weights])
                    except Exception as exc:  # a config that does not compile is a result too
                        print(f"nf4_linear {k}->{n} M={m} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                        rows_out.append(("nf4_linear", f"{k}->{n}" + (" nested" if nested else ""), m, name,
                                         float("nan"), float("nan"), float("nan"), f"FAIL {type(exc).__name__}"))
                        continue
                    rows_out.append(("nf4_linear", f"{k}->{n}" + (" nested" if nested else ""), m, name, us,
                                     moved / us * 1e-3, 100 * moved / (us * 1e-6) / copy_bw, f"{err:.1e}"))
            del weights


def routings(tokens, count, gen):
    e, top_k = MOE["experts"], MOE["top_k"]
    out = []
    perm = torch.randperm(e, device=DEVICE, generator=gen)
    for i in range(count):
        if tokens == 1:  # disjoint expert sets: 16 calls in a row share no expert
            index = perm[(i % (e // top_k)) * top_k:][:top_k].view(1, top_k)
        else:
            index = torch.rand(tokens, e, device=DEVICE, generator=gen).topk(top_k, dim=-1).indices
        weights = torch.rand(tokens, top_k, device=DEVICE, generator=gen).softmax(-1).to(DTYPE)
        out.append((index, weights))
    return out


def bench_moe(rows_out, copy_bw, gen):
    e, h, i = MOE["experts"], MOE["hidden"], MOE["inter"]
    code = nf4_code(DEVICE)
    per_expert = {nested: nf4_bytes(2 * i, h, nested) + nf4_bytes(h, i, nested) for nested in (False, True)}
    bf16_gate_up = torch.randn(e, 2 * i, h, device=DEVICE, generator=gen).to(DTYPE) * 0.02
    bf16_down = torch.randn(e, h, i, device=DEVICE, generator=gen).to(DTYPE) * 0.02
    for nested in (False, True):
        gate_up, down = random_nf4(e, 2 * i, h, nested, gen), random_nf4(e, h, i, nested, gen)
        for tokens in ROWS:
            x = torch.randn(tokens, h, device=DEVICE, generator=gen).to(DTYPE)
            routes = routings(tokens, 32, gen)
            distinct = sum(r[0].unique().numel() for r in routes) / len(routes)
            moved = distinct * per_expert[nested] + 2 * tokens * h * 2
            want = fused_moe_experts_nf4_ref(x, *routes[0], gate_up, down, code)
            label = f"E{e} H{h} I{i} top8" + (" nested" if nested else "") + f" ({distinct:.0f} experts)"
            configs = MOE_CONFIGS if not nested else dict([next(iter(MOE_CONFIGS.items()))])
            for name, cfg in configs.items():
                run = lambda r, cfg=cfg: fused_moe_experts_nf4(x, *r, gate_up, down, code, moe_combine, cfg)  # noqa
                try:
                    err = rel_err(run(routes[0]), want)
                    us = graph_us([lambda r=r: run(r) for r in routes])
                except Exception as exc:
                    print(f"fused_moe_nf4 M={tokens} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    rows_out.append(("fused_moe_nf4", label, tokens, name, float("nan"), float("nan"), float("nan"),
                                     f"FAIL {type(exc).__name__}"))
                    continue
                rows_out.append(("fused_moe_nf4", label, tokens, name, us, moved / us * 1e-3,
                                 100 * moved / (us * 1e-6) / copy_bw, f"{err:.1e}"))
            if not nested:  # the bf16 kernels at the same routing, 2 B per weight
                moved_bf16 = distinct * 3 * h * i * 2 + 2 * tokens * h * 2
                run = lambda r: fused_moe_experts(x, *r, bf16_gate_up, bf16_down, moe_combine)  # noqa
                run(routes[0])
                us = graph_us([lambda r=r: run(r) for r in routes])
                rows_out.append(("fused_moe bf16", label, tokens, "fused_moe.py", us, moved_bf16 / us * 1e-3,
                                 100 * moved_bf16 / (us * 1e-6) / copy_bw, "-"))
        del gate_up, down


def check_graph_replay(gen):
    """Capture each kernel (split-K GEMV, both MoE paths) in a CUDA graph; replay must equal eager exactly."""
    code = nf4_code(DEVICE)
    w = random_nf4(None, 512, 2048, True, gen)
    x = torch.randn(8, 2048, device=DEVICE, generator=gen).to(DTYPE)
    e, h, i = 16, MOE["hidden"], MOE["inter"]
    gate_up, down = random_nf4(e, 2 * i, h, False, gen), random_nf4(e, h, i, False, gen)
    xm = torch.randn(8, h, device=DEVICE, generator=gen).to(DTYPE)
    index = torch.rand(8, e, device=DEVICE, generator=gen).topk(8, dim=-1).indices
    weights = torch.rand(8, 8, device=DEVICE, generator=gen).to(DTYPE)
    calls = {
        "nf4_linear split-K nested": lambda: nf4_linear(x, w.packed, w.absmax, code, 512, 2048,
                                                        nested_code=w.nested_code, nested_absmax=w.nested_absmax,
                                                        offset=w.offset),
        "fused_moe_nf4 fma": lambda: fused_moe_experts_nf4(xm, index, weights, gate_up, down, code, moe_combine,
                                                           NF4MoEConfig(use_dot=False)),
        "fused_moe_nf4 fma lookup3 pairs combine": lambda: fused_moe_experts_nf4(
            xm, index, weights, gate_up, down, code, moe_combine, NF4MoEConfig(use_dot=False, lookup=3, x_pairs=True,
                                                                               combine=True)),
        "fused_moe_nf4 dot": lambda: fused_moe_experts_nf4(xm, index, weights, gate_up, down, code, moe_combine,
                                                           NF4MoEConfig(use_dot=True)),
    }
    results = {}
    for name, fn in calls.items():
        eager = fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fn()
        graph.replay()
        torch.cuda.synchronize()
        results[name] = torch.equal(eager, captured)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["linear", "moe"], help="run one kernel's part")
    parser.add_argument("--rows", help="comma-separated token / activation row counts (default 1,8)")
    parser.add_argument("--configs", help="comma-separated config names to time (\"auto\" always runs), e.g. "
                                          "\"fma lookup4 pairs,auto lookup4\"")
    args = parser.parse_args()
    if args.rows:
        ROWS[:] = [int(r) for r in args.rows.split(",")]
    if args.configs:
        keep = set(args.configs.split(",")) | {"auto"}
        for table in (LINEAR_CONFIGS, MOE_CONFIGS):
            for name in set(table) - keep:
                del table[name]
    start = time.time()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    if args.only in (None, "linear"):
        bench_linear(rows, copy_bw, gen)
        print(f"nf4_linear done at {time.time() - start:.0f}s", flush=True)
    if args.only in (None, "moe"):
        bench_moe(rows, copy_bw, gen)
        print(f"fused_moe done at {time.time() - start:.0f}s", flush=True)
    replay = check_graph_replay(gen)
    print("graph replay == eager:", ", ".join(f"{k}: {v}" for k, v in replay.items()))
    print(f"\n{'kernel':15} {'shape':38} {'M':>2} {'config':27} {'us':>8} {'GB/s':>7} {'%copy':>6} {'rel err':>8}")
    for kernel, shape, m, name, us, gbs, pct, err in rows:
        print(f"{kernel:15} {shape:38} {m:>2} {name:27} {us:8.2f} {gbs:7.0f} {pct:6.1f} {err:>8}")
    best = {}
    for kernel, shape, m, name, us, *_ in rows:
        if kernel != "fused_moe bf16" and not math.isnan(us) and us < best.get((kernel, shape, m), (math.inf,))[0]:
            best[(kernel, shape, m)] = (us, name)
    print("\nbest config: " + "; ".join(f"{k[0]} {k[1]} M={k[2]}: {v[1]} ({v[0]:.1f} us)" for k, v in best.items()))
    print(f"total {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
