#!/usr/bin/env python3
"""What moegraph's decode kernels compile to on Hopper, without a GPU: instructions, barriers and spills per loop.

    python tools/sass_report.py                    # the NF4 decode kernels at Qwen3-30B-A3B's shapes, bf16
    python tools/sass_report.py --only gate_up --dump   # one family of rows, and the main loop's SASS of each
    python tools/sass_report.py --only attention        # decode attention's combine: spills by split count

Each row runs a launcher (nf4_moe.fused_moe_experts_nf4, nf4_gemv.nf4_linear_group) on CPU tensors with its
kernels swapped for recorders, then compiles every recorded launch for sm_90 with Triton's own ptxas and reads
the SASS with its nvdisasm, as the GPU would get it: pointer and integer arguments specialized as Triton does at
a launch (divisible by 16), USE_PDL on, DOT_FP32 and EXACT_MUL set as on CUDA. Per kernel it prints the main
loop's length (the longest backward branch), that per weight it handles per thread (weights of one loop step /
threads), its barriers (each a stall of the whole program), shared-memory loads, local-memory spills and the
shared memory the kernel takes. Static counts only: a kernel that issues fewer instructions is not faster until
a GPU run says so (benchmarks/nf4_kernels.py), but a loop that doubles its barriers or starts spilling is
visible here first. Triton here may differ from the GPU machine's (the header prints both versions it knows).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moegraph.kernels import decode_attention, fused_moe, moe_combine, nf4_gemv, nf4_moe
from moegraph.kernels._nf4 import NF4Tensors, nf4_code

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
LAUNCH_OPTIONS = ("num_warps", "num_stages", "launch_pdl")
TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.uint8: "u8",
         torch.int8: "i8", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
E, H, I = 8, 2048, 768  # Qwen3-30B-A3B's expert shapes (the compiled code does not depend on E)


class Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def _signature(kernel, args, kwargs):
    """(signature, constexprs, attrs, options) of one recorded launch, specialized as a CUDA launch would be."""
    names = list(kernel.arg_names)
    values = dict(zip(names, args), **{k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        value = values.get(name, kernel.params[i].default)
        if kernel.params[i].is_constexpr:
            signature[name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    if "USE_PDL" in names:
        constexprs[(names.index("USE_PDL"),)] = True
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    return signature, constexprs, attrs, options


def compile_sass(kernel, args, kwargs, cuda_overrides) -> tuple[str, int]:
    """(SASS text, shared-memory bytes) of one launch compiled for sm_90."""
    kwargs = dict(kwargs, **{k: v for k, v in cuda_overrides.items() if k in kernel.arg_names})
    signature, constexprs, attrs, options = _signature(kernel, args, kwargs)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET, options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    return sass, compiled.metadata.shared


def _instructions(sass: str) -> tuple[list[str], dict[str, int]]:
    ins, labels = [], {}
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(ins)
            continue
        match = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if match:
            ins.append(match.group(1).strip())
    return ins, labels


def main_loop(sass: str) -> list[str]:
    """The longest loop: instructions from a label to the branch back to it."""
    ins, labels = _instructions(sass)
    loops = []
    for i, text in enumerate(ins):
        branch = re.search(r"BRA\s+`\((\.L_x_\d+)\)", text)
        if branch and labels.get(branch.group(1), i + 1) <= i:
            loops.append(ins[labels[branch.group(1)]:i + 1])
    return max(loops, key=len, default=[])


def _opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


@dataclasses.dataclass
class Row:
    name: str
    kernel: str
    loop: int
    per_weight: float
    barriers: int
    lds: int
    spills: int
    shared: int
    top: str


def report(name: str, kernel, args, kwargs, weights_per_step: int, cuda_overrides, dump: bool) -> Row:
    sass, shared = compile_sass(kernel, args, kwargs, cuda_overrides)
    loop = main_loop(sass)
    ops = collections.Counter(_opcode(t) for t in loop)
    threads = 32 * kwargs.get("num_warps", 4)
    if dump:
        print(f"--- {name}: {kernel.fn.__name__} main loop\n" + "\n".join(loop))
    return Row(name, kernel.fn.__name__, len(loop), len(loop) / (weights_per_step / threads), ops["BAR"], ops["LDS"],
               sum(1 for t in sass.splitlines() if re.search(r"\b(LDL|STL)\b", t)), shared,
               " ".join(f"{op}:{n}" for op, n in ops.most_common(6)))


def _nf4(experts, rows, cols, gen):
    packed = torch.randint(0, 256, (experts, rows * cols // 2), dtype=torch.uint8, generator=gen)
    return NF4Tensors(packed, torch.rand(experts, rows * cols // 64, generator=gen), (experts, rows, cols))


def _record(module, names, call):
    """Run `call` with module's kernels `names` recording; {name: [(args, kwargs)]}."""
    saved = {n: getattr(module, n) for n in names}
    recorders = {n: Recorder(k) for n, k in saved.items()}
    try:
        for n, r in recorders.items():
            setattr(module, n, r)
        call()
    finally:
        for n, k in saved.items():
            setattr(module, n, k)
    return {n: r.launches for n, r in recorders.items()}


def moe_rows(tokens: int, configs: dict, dump: bool, only_gate_up: bool = False):
    gen = torch.Generator().manual_seed(0)
    gate_up, down, code = _nf4(E, 2 * I, H, gen), _nf4(E, H, I, gen), nf4_code("cpu")
    x = torch.randn(tokens, H).bfloat16()
    index = torch.stack([torch.randperm(E, generator=gen)[:8] for _ in range(tokens)])
    weights = torch.rand(tokens, 8).bfloat16()
    kernels = ("_gate_up_silu_nf4_kernel", "_down_nf4_kernel", "_down_combine_nf4_kernel")
    for label, cfg in configs.items():
        run = lambda cfg=cfg: nf4_moe.fused_moe_experts_nf4(x, index, weights, gate_up, down, code,  # noqa: E731
                                                            nf4_moe.moe_combine, cfg)
        # the grouping's and moe_combine's kernels recorded too (not reported): nothing launches on this machine
        launches = _record(nf4_moe, kernels, lambda: _record(
            fused_moe, ["_align_blocks_kernel", "_align_blocks_histogram_kernel"],
            lambda: _record(moe_combine, ["_moe_combine_kernel"], run)))
        for kernel_name in kernels[:1] if only_gate_up else kernels:
            if not launches[kernel_name]:  # the down kernel with or without the combine
                continue
            (args, kwargs), = launches[kernel_name]
            per_step = (2 if kernel_name.startswith("_gate") else 1) * kwargs["BLOCK_N"] * kwargs["BLOCK_K"]
            yield report(f"experts T={tokens} {label}", getattr(nf4_moe, kernel_name), args, kwargs, per_step,
                         _cuda_overrides(cfg), dump)


def qkv_rows(configs: dict, norm: bool, dump: bool):
    gen = torch.Generator().manual_seed(1)
    weights = [NF4Tensors(*_nf4(1, n, H, gen)[:2], (n, H)) for n in (4096, 512, 512)]
    x, code = torch.randn(1, H).bfloat16(), nf4_code("cpu")
    for label, cfg in configs.items():
        if norm:
            call = lambda: nf4_gemv.nf4_add_rms_norm_linear_group(x, x, torch.ones(H).bfloat16(), 1e-6,  # noqa
                                                                  weights, code, cfg)
        else:
            call = lambda: nf4_gemv.nf4_linear_group(x, weights, code, cfg)  # noqa: E731
        (args, kwargs), = _record(nf4_gemv, ["_nf4_linear_group_kernel"], call)["_nf4_linear_group_kernel"]
        # behind the norm a CUDA launch runs the words lookup on a normalized copy of the row
        overrides = dict(_cuda_overrides(cfg), NORMED_SCRATCH=norm and cfg.lookup == 5 and nf4_gemv.NORMED_WORDS)
        yield report(f"q/k/v{' +norm' if norm else ''} M=1 {label}", nf4_gemv._nf4_linear_group_kernel, args,
                     kwargs, kwargs["BLOCK_N"] * kwargs["BLOCK_K"], overrides, dump)


def attention_combine_rows(splits=(32, 64, 128, 132)):
    """Decode attention's combine for one 8192-key row at Qwen3's heads, max_splits as given, weighing the partials
    COMBINE_SPLITS at a time and all at once: (max_splits, partials a step, spill instructions, instructions)."""
    q = torch.randn(1, 32, 128, dtype=torch.bfloat16)
    cache = torch.zeros(1, 4, 8192, 128, dtype=torch.bfloat16)
    for max_splits in splits:
        for step in (decode_attention.COMBINE_SPLITS, 1 << 16):
            saved, decode_attention.COMBINE_SPLITS = decode_attention.COMBINE_SPLITS, step
            try:
                launches = _record(decode_attention, ["_split_kernel", "_combine_kernel"], lambda: decode_attention.
                                   decode_attention(q, cache, cache, torch.tensor([8000]), 0.1, max_splits=max_splits))
            finally:
                decode_attention.COMBINE_SPLITS = saved
            args, kwargs = launches["_combine_kernel"][0]
            sass, _ = compile_sass(decode_attention._combine_kernel, args, kwargs, {})
            spills = sum(1 for t in sass.splitlines() if re.search(r"\b(LDL|STL)\b", t))
            yield max_splits, kwargs["SPLITS_STEP"], spills, len(_instructions(sass)[0])


def _cuda_overrides(cfg) -> dict:
    """What a launch on this CPU decides otherwise than a CUDA one: the dtypes' paths and the GPU-only lookup."""
    return {"DOT_FP32": False, "EXACT_MUL": False, "LOOKUP": cfg.lookup}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=("gate_up", "experts", "qkv", "attention"), help="one family of rows")
    parser.add_argument("--dump", action="store_true", help="print each kernel's main loop")
    parser.add_argument("--configs", help="comma-separated row names to keep (e.g. lookup1,lookup3+x_pairs)")
    args = parser.parse_args(argv)
    if args.only == "attention":
        print(f"sm_90 SASS from Triton {triton.__version__}: decode attention's combine, 1 row, 8192 keys")
        for max_splits, step, spills, count in attention_combine_rows():
            print(f"max_splits {max_splits:4d}, {step:4d} partials a step: {spills:3d} spill instructions, "
                  f"{count} in all")
        return 0
    nf4_moe.INTERPRETER_BLOCK_N = None  # the CPU launches below take the GPU's tiles
    # the rows name every choice they make: the module defaults move once the GPU has timed them
    M = functools.partial(nf4_moe.NF4MoEConfig, lookup=1, x_pairs=False, combine=False)
    L = functools.partial(nf4_gemv.NF4LinearConfig, lookup=1, x_pairs=False)
    moe = {"lookup1": M(), "lookup3": M(lookup=3), "x_pairs": M(x_pairs=True), "lookup3+x_pairs": M(lookup=3,
                                                                                                    x_pairs=True),
           "lookup3+x_pairs+combine": M(lookup=3, x_pairs=True, combine=True),
           "lookup4": M(lookup=4), "lookup4+x_pairs": M(lookup=4, x_pairs=True), "lookup5": M(lookup=5),
           "thin 4/4 bk2048 w2 lookup3+x_pairs": M(gate_up_block_n=4, down_block_n=4, block_k=2048, num_warps=2,
                                                   lookup=3, x_pairs=True)}
    linear = {"lookup1": L(), "lookup3+x_pairs": L(lookup=3, x_pairs=True), "lookup4": L(lookup=4),
              "lookup4+x_pairs": L(lookup=4, x_pairs=True), "lookup5": L(lookup=5)}
    if args.configs:
        keep = set(args.configs.split(","))
        moe, linear = ({k: v for k, v in table.items() if k in keep} for table in (moe, linear))
    print(f"sm_90 SASS from Triton {triton.__version__} (ptxas {BIN}), torch {torch.__version__}; bf16 activations; "
          "per weight = loop instructions / (weights per step per thread); the module defaults now: experts "
          f"lookup {nf4_moe.LOOKUP}, x_pairs {nf4_moe.X_PAIRS}, combine {nf4_moe.PAIR_COMBINE}")
    rows = []
    if args.only in (None, "gate_up", "experts"):
        few = {k: moe[k] for k in ("lookup1", "lookup3+x_pairs", "lookup4+x_pairs", "lookup5") if k in moe}
        rows += list(moe_rows(1, moe, args.dump, args.only == "gate_up"))
        rows += list(moe_rows(8, few, args.dump, args.only == "gate_up"))
    if args.only in (None, "qkv"):
        rows += list(qkv_rows(linear, False, args.dump)) + list(qkv_rows(linear, True, args.dump))
    width = max(len(r.name) for r in rows)
    print(f"{'case':<{width}} {'kernel':<26} {'loop':>5} {'/weight':>8} {'BAR':>4} {'LDS':>4} {'spill':>5} "
          f"{'smem':>6}  top opcodes in the loop")
    for r in rows:
        print(f"{r.name:<{width}} {r.kernel:<26} {r.loop:>5} {r.per_weight:>8.2f} {r.barriers:>4} {r.lds:>4} "
              f"{r.spills:>5} {r.shared:>6}  {r.top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
