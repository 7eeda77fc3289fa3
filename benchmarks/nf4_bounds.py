"""What bounds the one-token NF4 expert kernels: their bytes, or their instructions? (issue 8, batch 1)

    cd benchmarks && python nf4_bounds.py          # ~1 minute on an H100

Qwen3-30B-A3B's experts (E 128, H 2048, I 768, top-8), one token, bf16, each row a CUDA-graph replay of 32 calls
back to back (as decode runs them). Three ways to time the same kernels:
- "DRAM": every call routes to another 8 experts (16 disjoint sets in turn: L2 cannot hold them), as decode does;
- "L2": every call routes to the same 8 experts (19 MB of NF4 weights stay in the 50 MB L2): what the kernels
  take when their bytes come fast, i.e. the instruction side;
- "loads only": a kernel that reads the gate_up (or down) bytes in the same grid, tiles and steps as the real
  kernel (one step in flight ahead of the one in use) and only XORs them: what the bytes take in that pattern.
If "loads only" is far below "DRAM" and "L2" close to it, the kernels are bound by their instructions; if
"loads only" is close to "DRAM", the access pattern is the bound. The table comes last.
"""

import torch
import triton
import triton.language as tl

from moegraph.kernels import nf4_moe
from moegraph.kernels.moe_combine import moe_combine
from moegraph.kernels.nf4_moe import NF4MoEConfig, fused_moe_experts_nf4, nf4_code
from nf4_kernels import DEVICE, DTYPE, MOE, copy_bandwidth, graph_us, nf4_bytes, random_nf4, routings


@triton.jit
def _loads_only_kernel(expert_ptr, w_ptr, out_ptr, row_words, stride_we_words, second_rows,
                       BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr, TWO: tl.constexpr):
    """XOR of the words W[expert, rows, :] (and rows + second_rows with TWO: gate and up), BLOCK_Q words a row a
    step, the next step loaded before this one is used (as _nf4_matmul_words)."""
    pair = tl.program_id(0)
    base = w_ptr.to(tl.pointer_type(tl.int32)) + tl.load(expert_ptr + pair).to(tl.int64) * stride_we_words
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_Q)
    first = base + rows[:, None] * row_words + cols[None, :]
    second = base + (rows + second_rows)[:, None] * row_words + cols[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_Q], dtype=tl.int32)
    words = tl.load(first)
    words2 = tl.load(second) if TWO else words
    for q in range(0, row_words, BLOCK_Q):
        live = (q + BLOCK_Q + cols < row_words)[None, :]
        next_words = tl.load(first + q + BLOCK_Q, mask=live, other=0)
        acc ^= words
        words = next_words
        if TWO:
            next_words2 = tl.load(second + q + BLOCK_Q, mask=live, other=0)
            acc ^= words2
            words2 = next_words2
    tl.store(out_ptr + pair * tl.num_programs(1) * BLOCK_N + rows, tl.xor_sum(acc, axis=1))


def _recorded_launches(x, route, gate_up, down, code, cfg):
    """The (gate_up, down) launches of one fused_moe_experts_nf4 call, as (args, kwargs) of nf4_moe._launch."""
    launches, launch = [], nf4_moe._launch
    nf4_moe._launch = lambda *args, **kwargs: launches.append((args, kwargs))
    try:
        fused_moe_experts_nf4(x, *route, gate_up, down, code, lambda out, *a: out, cfg)
    finally:
        nf4_moe._launch = launch
    return launches


def main():
    e, h, i, k = MOE["experts"], MOE["hidden"], MOE["inter"], MOE["top_k"]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    copy_bw = copy_bandwidth()
    code = nf4_code(DEVICE)
    gate_up, down = random_nf4(e, 2 * i, h, False, gen), random_nf4(e, h, i, False, gen)
    x = torch.randn(1, h, device=DEVICE, generator=gen).to(DTYPE)
    rotating = routings(1, 32, gen)
    same = [rotating[0]] * 32
    cfg = NF4MoEConfig()
    block_n = nf4_moe.ONE_TOKEN_BLOCK_N
    moved = {"gate_up": k * nf4_bytes(2 * i, h, False), "down": k * nf4_bytes(h, i, False)}
    moved["all"] = moved["gate_up"] + moved["down"]
    rows = []

    def add(kernel, how, calls):
        us = graph_us(calls)
        rows.append((kernel, how, us, moved[kernel] / us * 1e-3, 100 * moved[kernel] / (us * 1e-6) / copy_bw))
        print(rows[-1], flush=True)

    for how, routes in (("DRAM", rotating), ("L2", same)):
        add("all", how, [lambda r=r: fused_moe_experts_nf4(x, *r, gate_up, down, code, moe_combine, cfg)
                         for r in routes])
        launches = [_recorded_launches(x, r, gate_up, down, code, cfg) for r in routes]
        for index, kernel in enumerate(("gate_up", "down")):
            for calls in launches:
                nf4_moe._launch(*calls[index][0], **calls[index][1])  # compile and warm
            add(kernel, how, [lambda a=a[index]: nf4_moe._launch(*a[0], **a[1]) for a in launches])
    out = torch.empty(k * max(2 * i, h), dtype=torch.int32, device=DEVICE)
    for kernel, w, second_rows, rows_n, cols, tile in (("gate_up", gate_up, i, i, h, block_n[0]),
                                                        ("down", down, 0, h, i, block_n[1])):
        for step_k in (256, 512, 1024):
            words_per_row = cols // 8
            if step_k // 8 > words_per_row:
                continue
            calls = []
            for r in rotating:
                experts = r[0].reshape(-1).contiguous()
                grid = (k, triton.cdiv(rows_n, tile))
                call = lambda experts=experts, grid=grid: _loads_only_kernel[grid](
                    experts, w.packed, out, words_per_row, w.packed.stride(0) // 4, second_rows, BLOCK_N=tile,
                    BLOCK_Q=step_k // 8, TWO=kernel == "gate_up", num_warps=nf4_moe.NUM_WARPS)
                call()
                calls.append(call)
            add(kernel, f"loads only, BLOCK_K {step_k}", calls)
    print(f"\ncopy bandwidth {copy_bw / 1e12:.2f} TB/s; one token, {k} experts, tiles {block_n}, "
          f"{nf4_moe.NUM_WARPS} warps")
    print(f"{'kernel':8} {'bytes from':28} {'us':>7} {'GB/s':>6} {'%copy':>6}")
    for kernel, how, us, gbs, pct in rows:
        print(f"{kernel:8} {how:28} {us:7.2f} {gbs:6.0f} {pct:6.1f}")


if __name__ == "__main__":
    main()
