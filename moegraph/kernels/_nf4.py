"""NF4 weights in bitsandbytes' layout, shared by the NF4 kernels (nf4_gemv.py, nf4_moe.py).

A stack of E matrices W_e [N, K] (E = 1 for one Linear4bit weight), each flattened to N*K values and cut
into 64-value blocks (block b = elements [64b, 64b + 64) of the flattened expert):
- `packed` uint8, N*K/2 bytes per expert: byte j holds element 2j in its HIGH nibble, 2j+1 in its LOW one;
- `code` float32 [16]: the value of each 4-bit index (bitsandbytes' NF4 table);
- `absmax` float32 [E, nblocks]: W[e, i] = code[q_i] * absmax[e, i // 64], then rounded to the compute
  dtype (round-to-nearest-even, as a dequantize-then-matmul in that dtype rounds);
- or nested ("double quantization"): `absmax` uint8 [E, nblocks] with `nested_code` float32 [256],
  `nested_absmax` float32 [E, ceil(nblocks / 256)], `offset` float32 [E]:
  absmax[e, b] = nested_code[absmax_q[e, b]] * nested_absmax[e, b // 256] + offset[e] (fp32, mul then add).

The jit helpers dequantize a [BLOCK_N, BLOCK_K] tile in registers as its even and odd columns, two
[BLOCK_N, BLOCK_K // 2] tiles: the high and low nibbles of the same bytes. Callers multiply them by the
even and odd columns of x (a tiny tile), so no interleave (join + reshape) of the weight tile is needed
and its registers stay in the layout they were loaded in. Two numerics, one per path:
- multiply-add (one activation row, decode GEMV): sum(code[q] * x) over each byte pair, scaled by the
  absmax once: the exact float32 NF4 values, never rounded to the compute dtype. Per weight that saves
  the absmax multiply and the bf16 round trip of each value: ~7 instructions instead of ~9 in the loop
  (SASS of the H200 build), and decode NF4 is bound by instructions, not bytes;
- tensor cores: code[q] * absmax rounded to the compute dtype (tl.dot takes bf16/fp16 operands), the
  values bitsandbytes' dequantize_4bit gives in that dtype.
"""

import os
from typing import NamedTuple, Optional, Tuple

import torch

from ..errors import InvalidArgumentError
from ..quant.nf4 import BLOCKSIZE, COMPUTE_DTYPES, NESTED_BLOCKSIZE, NF4_CODE  # the format: one place
from ._triton import HAVE_TRITON, pdl_wait, tl, triton
from .gemv import normed_input

if HAVE_TRITON:
    from triton.language.extra import libdevice
else:  # pragma: no cover - Triton missing: only the _ref functions run
    libdevice = None

QUANT_BLOCK = BLOCKSIZE  # the only 4-bit blocksize the kernels take
NESTED_BLOCK = NESTED_BLOCKSIZE
_NESTED_BLOCK = tl.constexpr(NESTED_BLOCK)
_COMPUTE_DTYPES = COMPUTE_DTYPES


# LOOKUP 4. A thread's table value: code[lane % 16] ($1: code_ptr).
_LANE_CODE_ASM = tl.constexpr("""{
    .reg .u32 lane;
    .reg .u64 offset, address;
    mov.u32 lane, %laneid;
    and.b32 lane, lane, 15;
    mul.wide.u32 offset, lane, 4;
    add.s64 address, $1, offset;
    ld.global.nc.f32 $0, [address];
}""")


def _shuffled_codes(word: str, table: str, out: list) -> str:
    """PTX putting code[nibble] of element j of the 32-bit `word` (element 2i: the high nibble of byte i, byte i in
    bits 8i..8i+7) into register out[j], j < 8, from `table`, each lane's code[lane % 16]: shfl.sync.idx reads the
    table value of lane (index & 31), and for a nibble in the index's low bits that is lane nibble or nibble + 16,
    both holding code[nibble], so a shift is all an index needs (registers s0-s6). No shared memory, no address
    arithmetic; every lane of the warp runs it (the loops have no divergent branch)."""
    shifts = [8 * (j // 2) + 4 * (1 - j % 2) for j in range(8)]
    index = {shift: f"s{i}" for i, shift in enumerate(sorted(set(shifts) - {0}))}
    lines = [f"shr.b32 {reg}, {word}, {shift};" for shift, reg in index.items()]
    lines += [f"shfl.sync.idx.b32 {dst}, {table}, {index.get(shift, word)}, 31, 0xffffffff;"
              for dst, shift in zip(out, shifts)]
    return "".join(f"\n    {line}" for line in lines) + "\n"


# LOOKUP 4: four bytes ($8) to code[high nibble] ($0-$3) and code[low nibble] ($4-$7); $9: the thread's table value
_SHUFFLE_LOOKUP_ASM = tl.constexpr("{\n    .reg .b32 s<7>;"
                                   + _shuffled_codes("$8", "$9", ["$0", "$4", "$1", "$5", "$2", "$6", "$3", "$7"])
                                   + "}")
# LOOKUP 5: 32-bit words of 8 weights each dotted with the same 8 x values (16-bit, the 16 bytes at the last
# operand, x0 in the low bits) in float32, in column order (_word_dot_asm).
_X_LOAD = {
    "bf16": (".reg .b32 lo, hi;", """
    ld.global.v2.b64 {xl, xh}, [ADDRESS];
    mov.b64 {lo, hi}, xl;
    shl.b32 x0, lo, 16;
    and.b32 x1, lo, 0xffff0000;
    shl.b32 x2, hi, 16;
    and.b32 x3, hi, 0xffff0000;
    mov.b64 {lo, hi}, xh;
    shl.b32 x4, lo, 16;
    and.b32 x5, lo, 0xffff0000;
    shl.b32 x6, hi, 16;
    and.b32 x7, hi, 0xffff0000;
"""),
    "fp16": (".reg .b16 h<8>;", """
    ld.global.v2.b64 {xl, xh}, [ADDRESS];
    mov.b64 {h0, h1, h2, h3}, xl;
    mov.b64 {h4, h5, h6, h7}, xh;
    cvt.f32.f16 x0, h0;
    cvt.f32.f16 x1, h1;
    cvt.f32.f16 x2, h2;
    cvt.f32.f16 x3, h3;
    cvt.f32.f16 x4, h4;
    cvt.f32.f16 x5, h5;
    cvt.f32.f16 x6, h6;
    cvt.f32.f16 x7, h7;
"""),
}


def _word_dot_asm(x_type: str, words: int) -> str:
    """PTX dotting `words` 32-bit words of 8 weights ($words .. $2words-1) with the same 8 x values into $0 ..
    $words-1; then the lane's table value (LOOKUP 4) and x's address. Each sum is c0 x0 + ... + c7 x7 in order
    (one mul, seven fma), so a word's sum has the same bits alone or beside another: two words of rows that
    share columns share one x load and its unpacking (8 instructions of ~32 a word). Where the two words already
    sat in one thread (gate and up) ptxas had merged the two loads of one address itself (the same SASS, sm_90);
    the gain is where it puts two rows in a thread that had one (_nf4_matmul's SHARE_X without TWO)."""
    regs, load = _X_LOAD[x_type]
    table, address = f"${2 * words}", f"${2 * words + 1}"
    lines = [load.replace("ADDRESS", address)]
    for w in range(words):
        lines.append(_shuffled_codes(f"${words + w}", table, [f"c{j}" for j in range(8)]))
        lines.append(f"    mul.rn.f32 ${w}, c0, x0;\n")
        lines += [f"    fma.rn.f32 ${w}, c{j}, x{j}, ${w};\n" for j in range(1, 8)]
    return "{\n    .reg .b32 s<7>, c<8>, x<8>;\n    .reg .b64 xl, xh;\n    " + regs + "".join(lines) + "}"


_WORD_DOT_ASM = {(x_type, words): tl.constexpr(_word_dot_asm(x_type, words)) for x_type in _X_LOAD
                 for words in (1, 2)}
_WORD_DOT_BF16_ASM, _WORD_DOT_FP16_ASM = _WORD_DOT_ASM["bf16", 1], _WORD_DOT_ASM["fp16", 1]
_WORD_DOT2_BF16_ASM, _WORD_DOT2_FP16_ASM = _WORD_DOT_ASM["bf16", 2], _WORD_DOT_ASM["fp16", 2]


def nf4_code(device) -> torch.Tensor:
    """The NF4 table as the kernels take it: float32 [16] on `device`."""
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


class NF4Tensors(NamedTuple):
    """One NF4 weight (shape (N, K)) or a stack of E of them (shape (E, N, K)); layout in the module docstring."""

    packed: torch.Tensor  # uint8, E*N*K/2 bytes: [E, N*K//2] for a stack, [N*K//2, 1] as Linear4bit holds it
    absmax: torch.Tensor  # float32 [E, nblocks] (or [nblocks]); uint8 when nested
    shape: Tuple[int, ...]  # (E, N, K) or (N, K)
    nested_code: Optional[torch.Tensor] = None  # float32 [256]
    nested_absmax: Optional[torch.Tensor] = None  # float32 [E, ceil(nblocks / 256)]
    offset: Optional[torch.Tensor] = None  # float32 [E] (a 0-d tensor for one Linear4bit)

    @property
    def nested(self) -> bool:
        return self.nested_code is not None

    @classmethod
    def from_bnb(cls, data: torch.Tensor, quant_state) -> "NF4Tensors":
        """From a bitsandbytes Params4bit: `cls.from_bnb(linear.weight.data, linear.weight.quant_state)`."""
        if quant_state.quant_type != "nf4" or quant_state.blocksize != QUANT_BLOCK:
            raise InvalidArgumentError(f"NF4Tensors.from_bnb: need quant_type 'nf4' with blocksize {QUANT_BLOCK}, got "
                                       f"{quant_state.quant_type!r} / {quant_state.blocksize}")
        if getattr(quant_state, "packing_format_for_cpu", False):
            raise InvalidArgumentError("NF4Tensors.from_bnb: this weight is in bitsandbytes' CPU-only packed layout "
                                       "(repacked by a Linear4bit forward on an AVX512-BF16 CPU); move the module to "
                                       "CUDA (`.cuda()` unpacks it) or run it through its own forward")
        shape = tuple(quant_state.shape)
        if not quant_state.nested:
            return cls(data, quant_state.absmax, shape)
        state2 = quant_state.state2
        if state2.blocksize != NESTED_BLOCK:
            raise InvalidArgumentError(f"NF4Tensors.from_bnb: nested blocksize {state2.blocksize}, the kernels take "
                                       f"{NESTED_BLOCK}")
        return cls(data, quant_state.absmax, shape, state2.code, state2.absmax, quant_state.offset)


class NF4View(NamedTuple):
    """NF4Tensors checked and flattened per expert, what the launchers pass to the kernels."""

    packed: torch.Tensor  # uint8 [E, N*K//2]
    absmax: torch.Tensor  # float32 or uint8 [E, nblocks]
    nested_code: torch.Tensor  # float32 [256] (absmax itself when not nested: never read)
    nested_absmax: torch.Tensor  # float32 [E, nested_blocks] (idem)
    offset: torch.Tensor  # float32 [E] (idem)
    experts: int
    rows: int  # N
    cols: int  # K
    nested: bool

    @property
    def aligned(self) -> bool:
        """Every row holds whole 64-blocks: one absmax per 64 columns of a row."""
        return self.cols % QUANT_BLOCK == 0


def check_nf4(op: str, t: NF4Tensors, code: torch.Tensor, device: torch.device) -> NF4View:
    """Validate one NF4 weight (stack) against its layout; raise InvalidArgumentError naming what was found."""
    shape = tuple(int(s) for s in t.shape)
    if len(shape) not in (2, 3):
        raise InvalidArgumentError(f"{op}: NF4 shape must be (N, K) or (E, N, K), got {shape}")
    experts, rows, cols = shape if len(shape) == 3 else (1, *shape)
    if cols % 2:
        raise InvalidArgumentError(f"{op}: K = {cols} is odd; two 4-bit values share a byte, so K must be even")
    per_expert = rows * cols
    nblocks = -(-per_expert // QUANT_BLOCK)
    for name, tensor, dtype, numel in (("packed", t.packed, torch.uint8, experts * per_expert // 2),
                                       ("absmax", t.absmax, torch.uint8 if t.nested else torch.float32,
                                        experts * nblocks),
                                       ("code", code, torch.float32, 16)):
        if tensor.dtype != dtype or tensor.numel() != numel or tensor.device != device:
            raise InvalidArgumentError(f"{op}: {name} must be {dtype} with {numel} elements on {device} for NF4 shape "
                                       f"{shape}; got {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")
        if not tensor.is_contiguous():
            raise InvalidArgumentError(f"{op}: {name} must be contiguous (call .contiguous() once, at load time)")
    absmax = t.absmax.view(experts, nblocks)
    if not t.nested:
        return NF4View(t.packed.view(experts, -1), absmax, absmax, absmax, absmax, experts, rows, cols, False)
    nested_blocks = -(-nblocks // NESTED_BLOCK)
    for name, tensor, numel in (("nested_code", t.nested_code, 256), ("nested_absmax", t.nested_absmax,
                                                                         experts * nested_blocks),
                                ("offset", t.offset, experts)):
        if tensor is None or tensor.dtype != torch.float32 or tensor.numel() != numel or tensor.device != device:
            found = None if tensor is None else f"{tensor.dtype} {tuple(tensor.shape)} on {tensor.device}"
            raise InvalidArgumentError(f"{op}: nested NF4 needs {name} float32 with {numel} elements on {device}; "
                                       f"got {found}")
    return NF4View(t.packed.view(experts, -1), absmax, t.nested_code.contiguous(),
                   t.nested_absmax.reshape(experts, nested_blocks).contiguous(), t.offset.reshape(experts).contiguous(),
                   experts, rows, cols, True)


LOOKUPS = (0, 1, 2, 3, 4, 5)  # the forms of the code table (_nf4_codes; 5: _nf4_matmul_words)
LOOKUP_SHUFFLE = 4  # from here on the forms are PTX (warp shuffles): resolve_lookup takes LOOKUP 1 off CUDA
LOOKUP_WORDS = 5  # LOOKUP 4 a 32-bit word of weights at a time (_nf4_matmul_words)
# Triton's interpreter runs no PTX: the word asm's arithmetic is emulated there (_word_dot)
_EMULATE_PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


def resolve_lookup(lookup: int, x: torch.Tensor, *packed: torch.Tensor) -> int:
    """The lookup a launch on activations x and weight bytes `packed` (each) runs: LOOKUP_SHUFFLE on NVIDIA GPUs only
    (not under Triton's interpreter), else LOOKUP 1 (the same values, the same bits); LOOKUP_WORDS on them or
    interpreted (its asm emulated), where x starts on 16 bytes and the bytes on 4 (its loads), else the shuffle (or
    1). LOOKUP_WORDS sums each word of 8 products first: other bits than 1 and 4, so an x that moves between
    aligned and unaligned addresses changes them (the decoder's are whole allocations: aligned)."""
    interpreted = bool(_EMULATE_PTX)  # read once, at import, as the kernels read it
    native = x.device.type == "cuda" and torch.version.hip is None and not interpreted
    if lookup == LOOKUP_WORDS and (native or interpreted):
        if x.data_ptr() % 16 == 0 and all(p.data_ptr() % 4 == 0 for p in packed):
            return lookup
        lookup = LOOKUP_SHUFFLE
    if lookup >= LOOKUP_SHUFFLE and not native:
        return 1
    return lookup


def check_lookup(op: str, lookup: int) -> int:
    if lookup not in LOOKUPS:
        raise InvalidArgumentError(f"{op}: lookup={lookup!r} is not one of {LOOKUPS} (the code table's forms: "
                                   "0 L1 gather, 1 shared 16 values, 2 shared 256 byte pairs, 3 as 1 in one gather, "
                                   "4 warp shuffles from a table held one value a lane, 5 as 4 a 32-bit word a "
                                   "time)")
    return lookup


def pairs_readable(x: torch.Tensor, x_pairs: bool) -> bool:
    """X_PAIRS for a launch on activations x: asked for, and x starts on a 4-byte boundary (its rows then do too: K
    is even), so that its 32-bit pair loads are aligned (a view may start mid-word)."""
    return bool(x_pairs) and x.data_ptr() % 4 == 0


def check_compute_dtype(op: str, x: torch.Tensor):
    if x.dtype not in _COMPUTE_DTYPES:
        raise InvalidArgumentError(f"{op}: activations must be float32, float16 or bfloat16, got {x.dtype}")


@triton.jit
def _nf4_absmax(absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, block, mask, NESTED: tl.constexpr,
                EXACT_MUL: tl.constexpr):
    """fp32 absmax of the 64-blocks `block` (any shape) of one expert, whose pointers are given; 0 where masked."""
    if NESTED:
        q = tl.load(absmax_ptr + block, mask=mask, other=0).to(tl.int32)
        scale = tl.load(nested_absmax_ptr + block // _NESTED_BLOCK, mask=mask, other=0.0)
        value = tl.load(nested_code_ptr + q)
        if EXACT_MUL:
            value = libdevice.mul_rn(value, scale)  # a rounded mul that ptxas may not contract with the add
        else:
            value = value * scale
        absmax = tl.where(mask, value + tl.load(offset_ptr), 0.0)
    else:
        absmax = tl.load(absmax_ptr + block, mask=mask, other=0.0)
    return absmax


@triton.jit
def _nf4_load(w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, rows, row_mask, kb, kb_end,
              row_bytes, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ALIGNED: tl.constexpr, NESTED: tl.constexpr,
              EXACT_MUL: tl.constexpr):
    """The bytes W[rows, 2 kb : 2 kb + BLOCK_K] ([BLOCK_N, BLOCK_K // 2] uint8, 0 past kb_end) and their absmax.

    kb is a byte offset in the rows (a multiple of 16 wherever it can be), so the byte tile loads as 16-byte
    vectors; the absmax is [BLOCK_N, BLOCK_K // 64] (ALIGNED: one per 32 bytes of a row) or one per byte.
    """
    HALF: tl.constexpr = BLOCK_K // 2
    byte = kb + tl.arange(0, HALF)
    mask = row_mask[:, None] & (byte < kb_end)[None, :]
    packed = tl.load(w_ptr + rows[:, None] * row_bytes + byte[None, :], mask=mask, other=0)
    if ALIGNED:
        # K % 64 == 0: a row holds whole 64-blocks (32 bytes)
        group = kb // 32 + tl.arange(0, BLOCK_K // 64)
        absmax = _nf4_absmax(absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr,
                             rows[:, None] * (row_bytes // 32) + group[None, :],
                             row_mask[:, None] & (group < kb_end // 32)[None, :], NESTED, EXACT_MUL)
    else:
        # a 64-block may span rows: its index per byte (both nibbles of a byte share a block: 64 is even)
        absmax = _nf4_absmax(absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr,
                             (rows[:, None] * row_bytes + byte[None, :]) // 32, mask, NESTED, EXACT_MUL)
    return packed, absmax


@triton.jit
def _broadcast_absmax(absmax, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ALIGNED: tl.constexpr):
    """absmax per byte of the tile, [BLOCK_N, BLOCK_K // 2] (ALIGNED: one per 32 bytes of a row, broadcast)."""
    if ALIGNED:
        G: tl.constexpr = BLOCK_K // 64
        absmax = tl.reshape(tl.broadcast_to(absmax[:, :, None], [BLOCK_N, G, 32]), [BLOCK_N, BLOCK_K // 2])
    return absmax


@triton.jit
def _nf4_codes(packed, code_ptr, table, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOOKUP: tl.constexpr):
    """code[high nibble], code[low nibble] of each byte: float32 [BLOCK_N, BLOCK_K // 2] each."""
    HALF: tl.constexpr = BLOCK_K // 2
    if LOOKUP == 4:  # warp shuffles: lane l holds code[l % 16] (table), a nibble names the lane to read
        code_even, code_odd = tl.inline_asm_elementwise(_SHUFFLE_LOOKUP_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r",
                                                        [packed, table], dtype=(tl.float32, tl.float32),
                                                        is_pure=True, pack=4)
    elif LOOKUP == 0:  # global gather from the 64-byte table (one L1 line): a 64-bit address per value
        code_even = tl.load(code_ptr + (packed >> 4).to(tl.int32))
        code_odd = tl.load(code_ptr + (packed & 0xF).to(tl.int32))
    elif LOOKUP == 1:  # the 16 values in shared memory (tl.gather): a 32-bit address, no bank conflict
        code_even = tl.reshape(tl.gather(table, tl.reshape((packed >> 4).to(tl.int32), [BLOCK_N * HALF]), 0),
                               [BLOCK_N, HALF])
        code_odd = tl.reshape(tl.gather(table, tl.reshape((packed & 0xF).to(tl.int32), [BLOCK_N * HALF]), 0),
                              [BLOCK_N, HALF])
    elif LOOKUP == 3:  # as 1, both nibbles in one gather: one shared-memory round trip (two barriers) a step
        both = tl.reshape(tl.join((packed >> 4).to(tl.int32), (packed & 0xF).to(tl.int32)), [BLOCK_N * HALF * 2])
        code_even, code_odd = tl.split(tl.reshape(tl.gather(table, both, 0), [BLOCK_N, HALF, 2]))
    else:  # 256 (even, odd) pairs in shared memory, indexed by the whole byte: one 8-byte load per byte
        pair = tl.reshape(tl.gather(table, tl.reshape(packed.to(tl.int32), [BLOCK_N * HALF]), 0), [BLOCK_N, HALF])
        code_even = (pair >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
        code_odd = (pair & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    return code_even, code_odd


@triton.jit
def _nf4_decode(packed, absmax, code_ptr, table, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                ALIGNED: tl.constexpr, LOOKUP: tl.constexpr):
    """(even, odd) columns of the tile in DTYPE: code[high nibble] * absmax and code[low nibble] * absmax, in the
    layout the bytes were loaded in (no shuffle of the tile)."""
    code_even, code_odd = _nf4_codes(packed, code_ptr, table, BLOCK_N, BLOCK_K, LOOKUP)
    absmax = _broadcast_absmax(absmax, BLOCK_N, BLOCK_K, ALIGNED)
    return (code_even * absmax).to(DTYPE), (code_odd * absmax).to(DTYPE)


@triton.jit
def _nf4_table(code_ptr, LOOKUP: tl.constexpr):
    """The lookup table of LOOKUP 1 and 3 (code [16] fp32), 2 (uint64 [256]: code[b >> 4] bits high, code[b & 15]
    low) or 4 (the scalar code[lane % 16])."""
    if LOOKUP == 4:
        # code[lane % 16] in each thread: a scalar (each thread computes its own and keeps it in one register; a
        # tensor could be moved between threads by a layout conversion and hand each lane another lane's value),
        # which the lookups' asm splats where they use it. "pure": the table is constant
        table = tl.inline_asm_elementwise(_LANE_CODE_ASM, "=r,l", [code_ptr], dtype=tl.float32, is_pure=True, pack=1)
    elif LOOKUP == 2:
        b = tl.arange(0, 256)
        high = tl.load(code_ptr + (b >> 4)).to(tl.uint32, bitcast=True).to(tl.uint64)
        low = tl.load(code_ptr + (b & 0xF)).to(tl.uint32, bitcast=True).to(tl.uint64)
        table = (high << 32) | low
    else:
        table = tl.load(code_ptr + tl.arange(0, 16))
    return table


@triton.jit
def _nf4_accumulate(acc, packed, absmax, x_even, x_odd, code_ptr, table, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, ALIGNED: tl.constexpr,
                    LOOKUP: tl.constexpr, STEP_SUM: tl.constexpr):
    if not USE_DOT:
        # the NF4 values in float32, never rounded: sum code * x over the tile, then scale by each absmax once
        codes_even, codes_odd = _nf4_codes(packed, code_ptr, table, BLOCK_N, BLOCK_K, LOOKUP)
        partial = codes_even * x_even  # x [1, HALF], or [BLOCK_N, HALF] loaded in the tile's layout
        partial += codes_odd * x_odd
        partial = partial * _broadcast_absmax(absmax, BLOCK_N, BLOCK_K, ALIGNED)
        if STEP_SUM:
            partial = tl.sum(partial, axis=1)
        acc += partial
    else:
        even, odd = _nf4_decode(packed, absmax, code_ptr, table, DTYPE, BLOCK_N, BLOCK_K, ALIGNED, LOOKUP)
        if DOT_FP32:
            # fp32 operands: fp32 data (ieee, no tf32 rounding), or the CPU interpreter (bf16 dots are wrong there)
            acc = tl.dot(even.to(tl.float32), tl.trans(x_even.to(tl.float32)), acc, input_precision="ieee")
            acc = tl.dot(odd.to(tl.float32), tl.trans(x_odd.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(even, tl.trans(x_even.to(DTYPE)), acc)
            acc = tl.dot(odd, tl.trans(x_odd.to(DTYPE)), acc)
    return acc


@triton.jit
def _nf4_matmul(x_ptr, x_rows, x_mask, w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, code_ptr,
                rows, rows2, row_mask, kb_start, kb_end, row_bytes, DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
                ALIGNED: tl.constexpr, NESTED: tl.constexpr, EXACT_MUL: tl.constexpr, LOOKUP: tl.constexpr,
                TWO: tl.constexpr, res_ptr=None, nw_ptr=None, inv_rms=None, NORM: tl.constexpr = False,
                HAS_ADD: tl.constexpr = False, X_PAIRS: tl.constexpr = False, WAIT: tl.constexpr = 0,
                SHARE_X: tl.constexpr = False):
    """_nf4_matmul_bytes, or with LOOKUP 5 on the multiply-add path (16-bit x, no norm, whole 64-blocks per row)
    _nf4_matmul_words; LOOKUP 5 elsewhere reads the table as LOOKUP 4 (1 under the interpreter).
    WAIT: the caller's PDL mode (pdl_wait) where it leaves the wait to this loop, else 0: the words loop issues its
    first step's weight loads (static: no earlier kernel's output) before waiting, so their latency overlaps the
    previous kernel's tail; the bytes loop waits first.
    SHARE_X (words loop): each thread decodes two words of the same columns against one x load, rows and rows2
    when TWO (the same bits), else rows 2i and 2i + 1 of the tile: each word's sum is unchanged, but the tile
    of half the rows may take another layout on the GPU and so another order in the sum over a row's words."""
    WORDS: tl.constexpr = (LOOKUP == 5 and not USE_DOT and not NORM and ALIGNED
                           and x_ptr.dtype.element_ty.primitive_bitwidth == 16)
    if WORDS and SHARE_X and not TWO and BLOCK_N >= 2:
        HALF_N: tl.constexpr = BLOCK_N // 2
        rows_even, rows_odd = tl.split(tl.reshape(rows, [HALF_N, 2]))
        mask_even, mask_odd = tl.split(tl.reshape(row_mask, [HALF_N, 2]))
        even, odd = _nf4_matmul_words(x_ptr, x_rows, w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr,
                                      offset_ptr, code_ptr, rows_even, rows_odd, mask_even, mask_odd, kb_start,
                                      kb_end, row_bytes, HALF_N, BLOCK_K, NESTED, EXACT_MUL, True, WAIT, True)
        acc = tl.reshape(tl.join(even, odd), [BLOCK_N])
        acc2 = acc
    elif WORDS:
        acc, acc2 = _nf4_matmul_words(x_ptr, x_rows, w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr,
                                      code_ptr, rows, rows2, row_mask, row_mask, kb_start, kb_end, row_bytes, BLOCK_N,
                                      BLOCK_K, NESTED, EXACT_MUL, TWO, WAIT, SHARE_X)
    else:
        pdl_wait(WAIT)
        acc, acc2 = _nf4_matmul_bytes(x_ptr, x_rows, x_mask, w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr,
                                      offset_ptr, code_ptr, rows, rows2, row_mask, kb_start, kb_end, row_bytes, DTYPE,
                                      BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, DOT_FP32, ALIGNED, NESTED, EXACT_MUL,
                                      (1 if _EMULATE_PTX else 4) if LOOKUP == 5 else LOOKUP, TWO, res_ptr, nw_ptr,
                                      inv_rms, NORM, HAS_ADD,
                                      X_PAIRS)
    return acc, acc2


@triton.jit
def _nf4_matmul_bytes(x_ptr, x_rows, x_mask, w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr,
                      code_ptr, rows, rows2, row_mask, kb_start, kb_end, row_bytes, DTYPE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
                      DOT_FP32: tl.constexpr, ALIGNED: tl.constexpr, NESTED: tl.constexpr, EXACT_MUL: tl.constexpr,
                      LOOKUP: tl.constexpr, TWO: tl.constexpr, res_ptr, nw_ptr, inv_rms, NORM: tl.constexpr,
                      HAS_ADD: tl.constexpr, X_PAIRS: tl.constexpr):
    """W[rows, 2 kb_start : 2 kb_end] @ x[x_rows, same columns]^T in float32 (and the same for rows2 when TWO,
    sharing the x loads: gate and up); x [*, K = 2 row_bytes] row-major. Returns (acc, acc2), acc2 = acc if not TWO.
    NORM: x is the RMSNorm of (residual at res_ptr +) x, weight nw_ptr, normalized here slice by slice (gemv.py's
    normed_input) with inv_rms, the rows' 1 / RMS (a scalar for the one row, else [BLOCK_M]).

    USE_DOT: [BLOCK_N, BLOCK_M], tensor cores with the weight tile as the left operand (the wide side; x pads to
    BLOCK_M >= 16 rows, x_rows [BLOCK_M] with x_mask). Otherwise [BLOCK_N] for the one row x_rows (a scalar):
    a multiply-add per weight into a [BLOCK_N, BLOCK_K // 2] accumulator, summed once after the loop.
    The next step's bytes are loaded before this step's are decoded: 4-bit weights are cheap to hold in
    registers, and the loads in flight are what a bandwidth-bound loop needs.
    X_PAIRS (multiply-add path, 16-bit x, no NORM): x is read as 32-bit (even, odd) pairs straight into the weight
    tile's layout (L1 hits, one per byte of the tile) instead of two strided 1-D loads that a shared-memory layout
    conversion (and its barriers) then broadcasts over the rows.
    """
    HALF: tl.constexpr = BLOCK_K // 2
    # wide steps (few steps, many loads in flight) sum each step: a [BLOCK_N, HALF] accumulator would not fit
    STEP_SUM: tl.constexpr = BLOCK_K >= 512
    K = 2 * row_bytes
    table = _nf4_table(code_ptr, LOOKUP)
    if USE_DOT:
        tl.static_assert(BLOCK_M >= 16, "tl.dot needs BLOCK_M >= 16")
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        x_base = x_ptr + x_rows.to(tl.int64)[:, None] * K  # [BLOCK_M, 1]
    else:
        if STEP_SUM:
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_N, HALF], dtype=tl.float32)
        x_base = x_ptr + x_rows.to(tl.int64) * K
    PAIRS: tl.constexpr = X_PAIRS and not USE_DOT and not NORM and x_ptr.dtype.element_ty.primitive_bitwidth == 16
    if PAIRS:
        x_pairs = x_base.to(tl.pointer_type(tl.int32))  # K is even: x[2j], x[2j + 1] in word j
    acc2 = acc
    packed, absmax = _nf4_load(w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, rows, row_mask,
                               kb_start, kb_end, row_bytes, BLOCK_N, BLOCK_K, ALIGNED, NESTED, EXACT_MUL)
    packed2, absmax2 = packed, absmax
    if TWO:
        packed2, absmax2 = _nf4_load(w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, rows2,
                                     row_mask, kb_start, kb_end, row_bytes, BLOCK_N, BLOCK_K, ALIGNED, NESTED,
                                     EXACT_MUL)
    for kb in range(kb_start, kb_end, HALF):
        next_packed, next_absmax = _nf4_load(w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, rows,
                                             row_mask, kb + HALF, kb_end, row_bytes, BLOCK_N, BLOCK_K, ALIGNED, NESTED,
                                             EXACT_MUL)  # all masked off after the last step
        if TWO:
            next_packed2, next_absmax2 = _nf4_load(w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr,
                                                   rows2, row_mask, kb + HALF, kb_end, row_bytes, BLOCK_N, BLOCK_K,
                                                   ALIGNED, NESTED, EXACT_MUL)
        if USE_DOT:
            k = 2 * kb + tl.arange(0, BLOCK_K)
            x = tl.load(x_base + k[None, :], mask=x_mask[:, None] & (k < K)[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            if NORM:
                x = normed_input(x, res_ptr, nw_ptr, inv_rms[:, None], x_rows.to(tl.int64)[:, None] * K + k[None, :],
                                 x_mask[:, None] & (k < K)[None, :], k, k < K, NORM, HAS_ADD)
            x_even, x_odd = tl.split(tl.reshape(x, [BLOCK_M, HALF, 2]))
        elif PAIRS:
            byte = kb + tl.arange(0, HALF)
            pairs = tl.load(x_pairs + (byte[None, :] + tl.zeros([BLOCK_N, 1], dtype=tl.int32)),
                            mask=(byte < kb_end)[None, :], other=0)
            x_even, x_odd = _unpack_pairs(pairs, x_ptr.dtype.element_ty)
        else:
            # 1-D strided x loads (L1 hits): a 2-D x tile would pull the weight tile into its layout
            k_even = 2 * (kb + tl.arange(0, HALF))
            k_mask = k_even < K
            x_even = tl.load(x_base + k_even, mask=k_mask, other=0.0)
            x_odd = tl.load(x_base + k_even + 1, mask=k_mask, other=0.0)
            if NORM:
                row = x_rows.to(tl.int64) * K
                x_even = normed_input(x_even, res_ptr, nw_ptr, inv_rms, row + k_even, k_mask, k_even, k_mask, NORM,
                                      HAS_ADD)
                x_odd = normed_input(x_odd, res_ptr, nw_ptr, inv_rms, row + k_even + 1, k_mask, k_even + 1, k_mask,
                                     NORM, HAS_ADD)
            x_even = x_even.to(tl.float32)[None, :]
            x_odd = x_odd.to(tl.float32)[None, :]
        acc = _nf4_accumulate(acc, packed, absmax, x_even, x_odd, code_ptr, table, DTYPE, BLOCK_N, BLOCK_K, USE_DOT,
                              DOT_FP32, ALIGNED, LOOKUP, STEP_SUM)
        packed, absmax = next_packed, next_absmax
        if TWO:
            acc2 = _nf4_accumulate(acc2, packed2, absmax2, x_even, x_odd, code_ptr, table, DTYPE, BLOCK_N, BLOCK_K,
                                   USE_DOT, DOT_FP32, ALIGNED, LOOKUP, STEP_SUM)
            packed2, absmax2 = next_packed2, next_absmax2
    if not USE_DOT and not STEP_SUM:
        acc = tl.sum(acc, axis=1)
        acc2 = tl.sum(acc2, axis=1)
    return acc, acc2


@triton.jit
def _nf4_load_words(w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, rows, row_mask, kb, kb_end,
                    row_bytes, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NESTED: tl.constexpr,
                    EXACT_MUL: tl.constexpr):
    """_nf4_load of whole 64-block rows as 32-bit words: W[rows, 2 kb : 2 kb + BLOCK_K] as [BLOCK_N, BLOCK_K // 8]
    int32 (word j: bytes 4j..4j+3, byte i in bits 8i..8i+7) and its absmax broadcast to the words."""
    Q: tl.constexpr = BLOCK_K // 8
    G: tl.constexpr = BLOCK_K // 64
    word = kb // 4 + tl.arange(0, Q)
    words = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (row_bytes // 4) + word[None, :],
                    mask=row_mask[:, None] & (word < kb_end // 4)[None, :], other=0)
    group = kb // 32 + tl.arange(0, G)
    absmax = _nf4_absmax(absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr,
                         rows[:, None] * (row_bytes // 32) + group[None, :],
                         row_mask[:, None] & (group < kb_end // 32)[None, :], NESTED, EXACT_MUL)
    return words, tl.reshape(tl.broadcast_to(absmax[:, :, None], [BLOCK_N, G, 8]), [BLOCK_N, Q])


@triton.jit
def _nf4_matmul_words(x_ptr, x_row, w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, code_ptr,
                      rows, rows2, row_mask, row_mask2, kb_start, kb_end, row_bytes, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, NESTED: tl.constexpr, EXACT_MUL: tl.constexpr, TWO: tl.constexpr,
                      WAIT: tl.constexpr = 0, SHARE_X: tl.constexpr = False):
    """The multiply-add path of _nf4_matmul_bytes (one row x_row of 16-bit x) a 32-bit word at a time: one asm per
    word of 8 weights shuffles their code values out of the lane table, loads their 8 x values (16 bytes, L1 hits)
    and sums the 8 products in float32 (in column order); the absmax scales each word's sum. Not "pure": its x
    load must stay after the kernel's wait on the kernel before it (PDL). Returns ([BLOCK_N], [BLOCK_N]) as
    _nf4_matmul; row_mask2 masks rows2. SHARE_X (with TWO): a word of rows and one of rows2 in one asm."""
    Q: tl.constexpr = BLOCK_K // 8
    HALF: tl.constexpr = BLOCK_K // 2
    if _EMULATE_PTX:
        table = 0.0  # _word_dot reads code_ptr instead
        x_row_at = x_row.to(tl.int64) * (4 * row_bytes)  # byte offsets from x_ptr
    else:
        table = _nf4_table(code_ptr, 4)
        x_row_at = (x_ptr + x_row.to(tl.int64) * (2 * row_bytes)).to(tl.int64)  # the row's address
    BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    ASM: tl.constexpr = _WORD_DOT_BF16_ASM if BF16 else _WORD_DOT_FP16_ASM
    ASM2: tl.constexpr = _WORD_DOT2_BF16_ASM if BF16 else _WORD_DOT2_FP16_ASM
    acc = tl.zeros([BLOCK_N, Q], dtype=tl.float32)
    acc2 = acc
    words, absmax = _nf4_load_words(w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, rows, row_mask,
                                    kb_start, kb_end, row_bytes, BLOCK_N, BLOCK_K, NESTED, EXACT_MUL)
    words2, absmax2 = words, absmax
    if TWO:
        words2, absmax2 = _nf4_load_words(w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, rows2,
                                          row_mask2, kb_start, kb_end, row_bytes, BLOCK_N, BLOCK_K, NESTED, EXACT_MUL)
    pdl_wait(WAIT)  # x (loaded in the asm) is an earlier kernel's output; the weights above are not
    for kb in range(kb_start, kb_end, HALF):
        next_words, next_absmax = _nf4_load_words(w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr,
                                                  rows, row_mask, kb + HALF, kb_end, row_bytes, BLOCK_N, BLOCK_K,
                                                  NESTED, EXACT_MUL)
        if TWO:
            next_words2, next_absmax2 = _nf4_load_words(w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr,
                                                        offset_ptr, rows2, row_mask2, kb + HALF, kb_end, row_bytes,
                                                        BLOCK_N, BLOCK_K, NESTED, EXACT_MUL)
        # x of word j: bytes 16 j .. 16 j + 15 of the row, loaded inside the asm (a load here would take its own
        # layout and move the word tile between threads each step); past the row's end the row start (in bounds;
        # values that the masked sum below leaves out: a masked word's codes are code[0], not 0)
        word = kb // 4 + tl.arange(0, Q)
        live = (word < kb_end // 4)[None, :]
        x_at = tl.where(live, x_row_at + 16 * word.to(tl.int64)[None, :], x_row_at + tl.zeros([BLOCK_N, Q], tl.int64))
        if TWO and SHARE_X:
            dot, dot2 = _word_dot2(words, words2, table, x_at, code_ptr, x_ptr, ASM2)
            acc = tl.where(live, acc + dot * absmax, acc)
            acc2 = tl.where(live, acc2 + dot2 * absmax2, acc2)
        else:
            acc = tl.where(live, acc + _word_dot(words, table, x_at, code_ptr, x_ptr, ASM) * absmax, acc)
            if TWO:
                acc2 = tl.where(live, acc2 + _word_dot(words2, table, x_at, code_ptr, x_ptr, ASM) * absmax2, acc2)
        words, absmax = next_words, next_absmax
        if TWO:
            words2, absmax2 = next_words2, next_absmax2
    out = tl.sum(acc, axis=1)
    return out, (tl.sum(acc2, axis=1) if TWO else out)


@triton.jit
def _word_dot(words, table, x_at, code_ptr, x_ptr, ASM: tl.constexpr):
    """sum over j of code[nibble j of the word] * x[j of the 8 at byte address x_at], in float32, j in order: the
    word asm; under Triton's interpreter (no PTX) the same arithmetic in Triton ops, x_at then a byte offset from
    x_ptr, so that the CPU tests run the words path around it."""
    if _EMULATE_PTX:
        x_first = x_at // 2  # in elements
        dot = tl.zeros(words.shape, dtype=tl.float32)
        for j in tl.static_range(8):
            SHIFT: tl.constexpr = 8 * (j // 2) + 4 * (1 - j % 2)  # element 2i: high nibble of byte i
            code = tl.load(code_ptr + ((words >> SHIFT) & 0xF))
            dot = tl.fma(code, tl.load(x_ptr + x_first + j).to(tl.float32), dot)
    else:
        dot = tl.inline_asm_elementwise(ASM, "=r,r,r,l", [words, table, x_at], dtype=tl.float32, is_pure=False,
                                        pack=1)
    return dot


@triton.jit
def _word_dot2(words, words2, table, x_at, code_ptr, x_ptr, ASM2: tl.constexpr):
    """_word_dot of two word tiles of the same columns (x_at) in one asm, one x load for both: the same bits."""
    if _EMULATE_PTX:
        dot = _word_dot(words, table, x_at, code_ptr, x_ptr, ASM2)
        dot2 = _word_dot(words2, table, x_at, code_ptr, x_ptr, ASM2)
    else:
        dot, dot2 = tl.inline_asm_elementwise(ASM2, "=r,=r,r,r,r,l", [words, words2, table, x_at],
                                              dtype=(tl.float32, tl.float32), is_pure=False, pack=1)
    return dot, dot2


@triton.jit
def _unpack_pairs(pairs, DTYPE: tl.constexpr):
    """float32 (even, odd) of int32 words that each hold two 16-bit values of DTYPE, the even one in the low half."""
    if DTYPE == tl.bfloat16:  # a bf16 is the high half of the float32 of the same value
        x_even = (pairs << 16).to(tl.float32, bitcast=True)
        x_odd = (pairs & -65536).to(tl.float32, bitcast=True)
    else:
        x_even = (pairs & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        x_odd = (pairs >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return x_even, x_odd


def dequantize_nf4_ref(t: NF4Tensors, code: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W in `dtype`, shaped t.shape: code[q] * absmax in float32, rounded once (bitsandbytes' dequantize_4bit)."""
    shape = tuple(int(s) for s in t.shape)
    experts, rows, cols = shape if len(shape) == 3 else (1, *shape)
    per_expert = rows * cols
    packed = t.packed.reshape(experts, per_expert // 2)
    q = torch.stack([packed >> 4, packed & 0xF], dim=-1).reshape(experts, per_expert).long()  # high nibble first
    absmax = t.absmax.reshape(experts, -1)
    if t.nested:
        scale = t.nested_absmax.reshape(experts, -1).repeat_interleave(NESTED_BLOCK, dim=1)[:, :absmax.shape[1]]
        absmax = t.nested_code.float()[absmax.long()] * scale + t.offset.reshape(experts, 1).float()
    absmax = absmax.float().repeat_interleave(QUANT_BLOCK, dim=1)[:, :per_expert]
    return (code.float()[q] * absmax).to(dtype).reshape(shape)
