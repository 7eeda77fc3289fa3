"""moegraph's 4-bit expert format: NF4 in exactly bitsandbytes' layout, one bnb tensor per expert.

A stack of E matrices W_e [N, K] (row-major) is stored as
- `packed`  uint8 [E, N*K//2]: per expert, W_e flattened to N*K values; element i gets the 4-bit index q_i
  of its nearest NF4 code value (`NF4_CODE`) after scaling by its block's absmax; byte j = (q_{2j} << 4) | q_{2j+1}
  (first element in the high nibble), as `bitsandbytes.functional.quantize_4bit(blocksize=64, quant_type="nf4")`
  packs one tensor;
- `absmax`  float32 [E, nblocks], nblocks = N*K//64: absmax[e, b] = max |w| over elements [64b, 64b+64);
- double quantization (bnb's compress_statistics=True), per expert as bnb does it for one tensor:
  offset[e] = mean of that expert's absmax; absmax - offset quantized blockwise to 8 bits (blocks of 256, bnb's
  signed dynamic code), giving `absmax` uint8 [E, nblocks], `nested_absmax` float32 [E, ceil(nblocks/256)],
  `nested_code` float32 [256], `offset` float32 [E].

Dequantization, in float32, then one rounding (to nearest even) to the compute dtype:
    absmax[e, b] = nested_code[qa[e, b]] * nested_absmax[e, b // 256] + offset[e]   (double quant only;
                   two float32 roundings: the product, then the sum; a kernel must not fuse them into an FMA)
    w[e, i]      = NF4_CODE[q[e, i]] * absmax[e, i // 64]
which is what `bitsandbytes.functional.dequantize_4bit` computes for `to_bnb(w, e)`, bit for bit.

How bitsandbytes rounds, and what `quantize_nf4` reproduces (read in bnb 0.50.2's source, checked against its CPU outputs):
- 4-bit (bnb's default torch kernel, the one its CPU backend runs): x = w * (1 / max(absmax, 1e-38)) in float32
  (a reciprocal, then a product: not a division), clamped to [-1, 1]; q = number of the 15 float32 midpoints
  (NF4_CODE[i] + NF4_CODE[i+1]) / 2 that are < x (`torch.bucketize`, right=False). A value exactly on a midpoint
  goes to the LOWER code. An all-zero block has absmax 0 and q = 7 (the code 0.0). bnb's CUDA kernel (read in its
  source, not run here) uses the same midpoints (its decision-tree constants round to them) and tie direction,
  but is built with --use_fast_math (its 1/absmax may be approximate) and gives an all-zero block q = 0.
- 8-bit, double quant (bnb's C++ CPU kernel): inv = 1 / block absmax (float32), x = clamp(v * inv, -1, 1), then
  not an exact nearest search but a 65536-entry table: t = trunc(((x + 1) * 0.5) * 65535 + 0.5), q = LUT[t], where
  LUT[t] = number of code midpoints (0.5 * (code[i] + code[i+1])) below -1 + (2 * t) / 65535. A block whose
  absmax is 0 gets q = 0. (Whether the compiler fuses `* 65535 + 0.5` into an FMA changes no t: checked over
  +-8 ulps around every table boundary.) bnb's CUDA kernel does a binary search with exact midpoints instead, so on
  CUDA bnb's own nested bytes can differ from these in a few codes; ours do not depend on the device.
- offset = `absmax[e].mean()`, the very torch call bnb makes on that expert's absmax, always run on the CPU.
  (torch's float32 CPU mean may differ in the last bit between CPU kinds (vector widths), as bnb's does.)
So the bytes equal bnb's CPU output on the same machine, and on CUDA `quantize_nf4` runs the same IEEE float32
torch ops (eager: no FMA contraction), so it should give the same bytes there (not yet checked on a GPU).

Everything here is plain torch (no bitsandbytes needed) except `to_bnb` / `from_bnb`, which import it lazily.
FP4 (bnb quant_type="fp4") is not supported: `from_bnb` refuses it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError

BLOCKSIZE = 64  # elements per absmax; bnb's default 4-bit blocksize, the one Qwen3 NF4 checkpoints use
NESTED_BLOCKSIZE = 256  # absmax values per nested absmax (bnb's compress_statistics blocksize)
# Experts quantized per step: bounds the float32/int32 temporaries (~13 B per element, ~100 MB here) while a
# Qwen3-30B-A3B gate_up layer (128 x 1536 x 2048, 805 MB in bf16) goes through in 64 steps of 2 experts.
MAX_CHUNK_ELEMENTS = 1 << 23

COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# bnb's NF4 table (`bitsandbytes.functional.get_4bit_type("nf4")`), index q -> value; sorted ascending.
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)

# The positive half of bnb's signed 8-bit dynamic code (`create_dynamic_map()`), shortest float32 decimals.
_DYNAMIC_POSITIVE = (
    # 10^-6 x midpoints of 1 equal step over [0.1, 1]
    5.5000004e-07,
    # 10^-5 x midpoints of 2 equal steps over [0.1, 1]
    3.2500002e-06, 7.75e-06,
    # 10^-4 x midpoints of 4 equal steps over [0.1, 1]
    2.1249998e-05, 4.375e-05, 6.625e-05, 8.875e-05,
    # 10^-3 x midpoints of 8 equal steps over [0.1, 1]
    1.5625001e-04, 2.6875004e-04, 3.8125002e-04, 4.9375003e-04, 6.062501e-04, 7.1875006e-04, 8.3125e-04,
    9.437501e-04,
    # 10^-2 x midpoints of 16 equal steps over [0.1, 1]
    0.0012812499, 0.00184375, 0.00240625, 0.00296875, 0.0035312497, 0.00409375, 0.0046562497, 0.0052187503,
    0.00578125, 0.00634375, 0.00690625, 0.00746875, 0.00803125, 0.00859375, 0.009156249, 0.00971875,
    # 10^-1 x midpoints of 32 equal steps over [0.1, 1]
    0.01140625, 0.01421875, 0.01703125, 0.019843752, 0.02265625, 0.02546875, 0.028281251, 0.03109375, 0.03390625,
    0.036718752, 0.03953125, 0.042343747, 0.04515625, 0.04796875, 0.05078125, 0.05359375, 0.05640625, 0.059218753,
    0.06203125, 0.06484375, 0.067656256, 0.070468746, 0.07328125, 0.07609375, 0.07890625, 0.08171876, 0.08453125,
    0.08734375, 0.09015625, 0.092968754, 0.09578126, 0.09859375,
    # 10^0 x midpoints of 64 equal steps over [0.1, 1]
    0.107031256, 0.12109375, 0.13515624, 0.14921875, 0.16328125, 0.17734376, 0.19140625, 0.20546874, 0.21953125,
    0.23359375, 0.24765624, 0.26171875, 0.27578127, 0.28984374, 0.30390626, 0.31796873, 0.33203125, 0.34609374,
    0.36015624, 0.37421876, 0.38828123, 0.40234375, 0.41640624, 0.43046874, 0.44453126, 0.45859373, 0.47265625,
    0.4867187, 0.50078124, 0.5148437, 0.5289062, 0.54296875, 0.5570313, 0.5710938, 0.58515626, 0.5992187,
    0.61328125, 0.6273438, 0.6414063, 0.65546876, 0.6695312, 0.68359375, 0.6976563, 0.7117188, 0.72578126,
    0.7398437, 0.75390625, 0.7679688, 0.78203124, 0.79609376, 0.8101562, 0.82421875, 0.8382813, 0.85234374,
    0.86640626, 0.8804687, 0.89453125, 0.9085938, 0.92265624, 0.93671876, 0.9507812, 0.96484375, 0.9789063,
    0.99296874,
)
# bnb's signed dynamic code, sorted: the negated positives, 0, the positives, 1.0 (256 values; code[0] = -0.99296874).
DYNAMIC_CODE = tuple(-v for v in reversed(_DYNAMIC_POSITIVE)) + (0.0,) + _DYNAMIC_POSITIVE + (1.0,)
assert len(NF4_CODE) == 16 and len(DYNAMIC_CODE) == 256

_LUT_SIZE = 65536  # bnb's CPU 8-bit quantizer discretizes [-1, 1] into this many bins


@functools.cache
def nf4_code(device: torch.device | str = "cpu") -> torch.Tensor:
    """NF4_CODE as a float32 [16] tensor on `device` (cached: do not modify it)."""
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


@functools.cache
def dynamic_code(device: torch.device | str = "cpu") -> torch.Tensor:
    """DYNAMIC_CODE as a float32 [256] tensor on `device` (cached: do not modify it)."""
    return torch.tensor(DYNAMIC_CODE, dtype=torch.float32, device=device)


@functools.cache
def _nf4_midpoints(device: torch.device) -> torch.Tensor:
    code = nf4_code(device)
    return (code[:-1] + code[1:]) / 2  # [15], float32, as bnb computes them


@functools.cache
def _dynamic_lut(device: torch.device) -> torch.Tensor:
    """bnb's CPU quantizer table: bin t of [-1, 1] -> 8-bit index, as int64 [65536] on `device`."""
    code = dynamic_code(device)
    midpoints = 0.5 * (code[:-1] + code[1:])
    centers = -1.0 + (2.0 * torch.arange(_LUT_SIZE, dtype=torch.float32, device=device)) / (_LUT_SIZE - 1)
    return torch.bucketize(centers, midpoints)  # number of midpoints < center


@dataclass(frozen=True, eq=False)
class NF4Weight:
    """E matrices [N, K] in NF4 (see the module docstring for the layout). Dequantizes to `dtype`."""

    packed: torch.Tensor  # uint8 [E, N*K//2]
    absmax: torch.Tensor  # float32 [E, nblocks]; uint8 [E, nblocks] when double-quantized
    shape: tuple[int, int, int]  # (E, N, K)
    dtype: torch.dtype  # compute dtype: what dequantize_nf4 returns
    nested_absmax: torch.Tensor | None = None  # float32 [E, ceil(nblocks/256)]
    nested_code: torch.Tensor | None = None  # float32 [256]
    offset: torch.Tensor | None = None  # float32 [E]

    def __post_init__(self):
        shape = tuple(int(s) for s in self.shape)
        if len(shape) != 3:
            raise InvalidArgumentError(f"NF4Weight.shape must be (E, N, K), got {self.shape}")
        object.__setattr__(self, "shape", shape)
        check_nf4_shape(shape)
        if self.dtype not in COMPUTE_DTYPES:
            raise InvalidArgumentError(f"NF4Weight compute dtype must be one of {COMPUTE_DTYPES}, got {self.dtype}")
        experts, nblocks = shape[0], self.nblocks
        nested = (self.nested_absmax, self.nested_code, self.offset)
        if any(t is None for t in nested) and not all(t is None for t in nested):
            raise InvalidArgumentError("NF4Weight: nested_absmax, nested_code and offset go together (double "
                                       "quantization); give all three or none")
        want = [("packed", self.packed, torch.uint8, (experts, shape[1] * shape[2] // 2)),
                ("absmax", self.absmax, torch.uint8 if self.double_quant else torch.float32, (experts, nblocks))]
        if self.double_quant:
            want += [("nested_absmax", self.nested_absmax, torch.float32, (experts, _nested_blocks(nblocks))),
                     ("nested_code", self.nested_code, torch.float32, (256,)),
                     ("offset", self.offset, torch.float32, (experts,))]
        for name, tensor, dtype, size in want:
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or tuple(tensor.shape) != size:
                found = (f"{tensor.dtype} {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor)
                         else type(tensor).__name__)
                raise InvalidArgumentError(f"NF4Weight {shape}: {name} must be {dtype} {size}, got {found}")
            if tensor.device != self.packed.device:
                raise InvalidArgumentError(f"NF4Weight: {name} is on {tensor.device}, packed on {self.packed.device}")

    @property
    def double_quant(self) -> bool:
        return self.offset is not None

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    @property
    def nblocks(self) -> int:
        """absmax values per expert."""
        return self.shape[1] * self.shape[2] // BLOCKSIZE

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by field name (nested ones only when double-quantized)."""
        names = ("packed", "absmax") + (("nested_absmax", "nested_code", "offset") if self.double_quant else ())
        return {name: getattr(self, name) for name in names}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> NF4Weight:
        """The same weight on `device` (the compute dtype is kept; use `with_dtype` to change it)."""
        moved = {k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors().items()}
        return NF4Weight(shape=self.shape, dtype=self.dtype, **moved)

    def with_dtype(self, dtype: torch.dtype) -> NF4Weight:
        """The same stored tensors, dequantizing to `dtype`."""
        return NF4Weight(shape=self.shape, dtype=dtype, **self.tensors())


def _nested_blocks(nblocks: int) -> int:
    return -(-nblocks // NESTED_BLOCKSIZE)


def check_nf4_shape(shape: Sequence[int]) -> None:
    """Raise InvalidArgumentError unless an [E, N, K] stack fits the format (N*K % 64 == 0, K even)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3 or min(shape) < 1:
        raise InvalidArgumentError(f"NF4 weights are a stack [E, N, K] of E >= 1 matrices, got shape {shape}")
    _, n, k = shape
    if (n * k) % BLOCKSIZE or k % 2:
        raise InvalidArgumentError(
            f"NF4 needs N*K % {BLOCKSIZE} == 0 (whole absmax blocks per expert) and K even (whole bytes per row); "
            f"shape {shape} has N*K = {n * k} (remainder {(n * k) % BLOCKSIZE}) and K = {k}")


def _quantize_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [C, nblocks, 64] (any float dtype) -> packed uint8 [C, nblocks*32], absmax float32 [C, nblocks]."""
    x = blocks.to(torch.float32)
    absmax = x.abs().amax(dim=-1)  # [C, nblocks]
    scaled = x * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(-1)  # reciprocal then product, as bnb
    del x
    q = torch.bucketize(scaled.clamp_(-1, 1), _nf4_midpoints(blocks.device), out_int32=True)  # ties -> lower
    del scaled
    q = q.to(torch.uint8).view(blocks.shape[0], -1)
    return (q[:, 0::2] << 4) | q[:, 1::2], absmax


def _quantize_dynamic(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values float32 [E, n] -> (q uint8 [E, n], absmax float32 [E, ceil(n/256)]): each row as bnb's CPU
    `quantize_blockwise(row, blocksize=256)` quantizes it with the dynamic code (table lookup, see above)."""
    experts, n = values.shape
    nested = _nested_blocks(n)
    blocks = torch.nn.functional.pad(values, (0, nested * NESTED_BLOCKSIZE - n))  # zeros change no block max
    blocks = blocks.view(experts, nested, NESTED_BLOCKSIZE)
    absmax = blocks.abs().amax(dim=-1)  # [E, nested]
    empty = (absmax == 0).unsqueeze(-1)
    x = (blocks * (1.0 / absmax).unsqueeze(-1)).clamp_(-1, 1)
    x = torch.where(empty, 0.0, x)  # 0 * inf: such a block gets index 0 below, as in bnb
    bins = ((x + 1.0) * 0.5 * (_LUT_SIZE - 1) + 0.5).to(torch.int64)  # truncation, as bnb's cast to uint16
    q = torch.where(empty, 0, _dynamic_lut(values.device)[bins]).to(torch.uint8)
    return q.view(experts, -1)[:, :n].contiguous(), absmax


def _double_quantize(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """absmax float32 [E, nblocks] -> (q uint8 [E, nblocks], nested_absmax float32 [E, nb2], offset float32 [E])."""
    # bnb's own call (float32 mean of that expert's absmax), made on the CPU whatever the device: torch's CUDA and
    # CPU reductions may differ in the last bit, and this keeps the bytes device-independent and equal to bnb's.
    offset = torch.stack([row.mean() for row in absmax.cpu()]).to(absmax.device)
    q, nested_absmax = _quantize_dynamic(absmax - offset[:, None])
    return q, nested_absmax, offset


@torch.no_grad()
def quantize_nf4(weight: torch.Tensor, *, double_quant: bool = False) -> NF4Weight:
    """weight [E, N, K] (float32 / float16 / bfloat16, any device) -> NF4Weight on the same device, dequantizing to
    weight.dtype. Each expert's bytes equal `bitsandbytes.functional.quantize_4bit(weight[e], blocksize=64,
    quant_type="nf4", compress_statistics=double_quant)` on the CPU. Experts go through in chunks of at most
    MAX_CHUNK_ELEMENTS elements, so temporaries stay ~13 bytes per chunk element."""
    if not isinstance(weight, torch.Tensor):
        raise InvalidArgumentError(f"quantize_nf4 needs a tensor [E, N, K], got {type(weight).__name__}")
    if weight.dtype not in COMPUTE_DTYPES:
        raise InvalidArgumentError(f"quantize_nf4 needs float32, float16 or bfloat16 weights, got {weight.dtype}")
    if weight.is_meta:
        raise InvalidArgumentError("quantize_nf4 got a meta tensor (no data): load the weights before quantizing")
    if weight.dim() != 3:
        raise InvalidArgumentError(f"quantize_nf4 needs a stack [E, N, K], got shape {tuple(weight.shape)}; "
                                   f"for one matrix use weight.unsqueeze(0)")
    check_nf4_shape(weight.shape)
    experts, n, k = weight.shape
    nblocks = n * k // BLOCKSIZE
    packed = torch.empty(experts, n * k // 2, dtype=torch.uint8, device=weight.device)
    absmax = torch.empty(experts, nblocks, dtype=torch.float32, device=weight.device)
    step = max(1, MAX_CHUNK_ELEMENTS // (n * k))
    for start in range(0, experts, step):
        stop = min(start + step, experts)
        chunk = weight[start:stop].reshape(stop - start, nblocks, BLOCKSIZE)
        packed[start:stop], absmax[start:stop] = _quantize_blocks(chunk)
    if not double_quant:
        return NF4Weight(packed, absmax, (experts, n, k), weight.dtype)
    qabsmax, nested_absmax, offset = _double_quantize(absmax)
    return NF4Weight(packed, qabsmax, (experts, n, k), weight.dtype, nested_absmax=nested_absmax,
                     nested_code=dynamic_code(weight.device).clone(), offset=offset)


def _expert_index(w: NF4Weight, experts) -> torch.Tensor | slice:
    if experts is None:
        return slice(None)
    if isinstance(experts, slice):
        return experts
    if isinstance(experts, int):
        if not -w.num_experts <= experts < w.num_experts:
            raise InvalidArgumentError(f"expert {experts} out of range for {w.num_experts} experts")
        experts %= w.num_experts
        return slice(experts, experts + 1)  # a view: no copy of the expert's bytes
    index = torch.as_tensor(experts, device=w.device)
    if index.dim() != 1 or index.dtype not in (torch.int64, torch.int32):
        raise InvalidArgumentError(f"experts must be an int, a sequence of ints or a 1-D integer tensor, "
                                   f"got {index.dtype} of shape {tuple(index.shape)}")
    return index.long()


@torch.no_grad()
def expert_absmax(w: NF4Weight, experts=None) -> torch.Tensor:
    """float32 [E', nblocks]: the per-block absmax, double quantization undone (bit-identical to bnb's)."""
    index = _expert_index(w, experts)
    if not w.double_quant:
        return w.absmax[index]
    qabsmax, nested_absmax, offset = w.absmax[index], w.nested_absmax[index], w.offset[index]
    rows = qabsmax.shape[0]
    scale = nested_absmax.repeat_interleave(NESTED_BLOCKSIZE, dim=1)[:, : w.nblocks]  # [E', nblocks]
    absmax = w.nested_code[qabsmax.long()] * scale  # one float32 product, then one sum: never fused
    return absmax + offset.view(rows, 1)


@torch.no_grad()
def dequantize_nf4(w: NF4Weight, experts=None) -> torch.Tensor:
    """[E', N, K] in w.dtype: all experts, or those selected by `experts` (an int keeps the expert dim).
    Pure torch, no host sync; bit-identical to bnb's dequantize_4bit of `to_bnb(w, e)`."""
    index = _expert_index(w, experts)
    packed = w.packed[index]
    absmax = expert_absmax(w, index)
    rows, (_, n, k) = packed.shape[0], w.shape
    out = torch.empty(rows, n, k, dtype=w.dtype, device=w.device)
    code = nf4_code(w.device)
    step = max(1, MAX_CHUNK_ELEMENTS // (n * k))
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        chunk = packed[start:stop]
        q = torch.stack((chunk >> 4, chunk & 0xF), dim=-1).view(stop - start, -1, BLOCKSIZE)  # high nibble first
        values = code[q.long()] * absmax[start:stop].unsqueeze(-1)  # float32, one rounding to w.dtype below
        out[start:stop] = values.view(stop - start, n, k)
    return out


def _bnb_functional():
    try:
        import bitsandbytes.functional as bnb_functional
    except ImportError as error:
        raise ImportError(f"to_bnb / from_bnb need bitsandbytes (pip install bitsandbytes): {error}") from error
    return bnb_functional


def _nf4_code_bnb(device):
    return _bnb_functional().get_4bit_type("nf4", device=device)


def to_bnb(w: NF4Weight, e: int):
    """Expert e as bitsandbytes sees one quantized tensor: (packed uint8 [N*K//2, 1], QuantState), sharing w's
    storage. `bitsandbytes.functional.dequantize_4bit(*to_bnb(w, e))` equals `dequantize_nf4(w)[e]` bit for bit."""
    QuantState = _bnb_functional().QuantState
    if not -w.num_experts <= e < w.num_experts:
        raise InvalidArgumentError(f"to_bnb: expert {e} out of range for {w.num_experts} experts")
    _, n, k = w.shape
    state2 = None
    if w.double_quant:
        state2 = QuantState(absmax=w.nested_absmax[e], code=w.nested_code, blocksize=NESTED_BLOCKSIZE,
                            dtype=torch.float32)
    state = QuantState(absmax=w.absmax[e], shape=torch.Size((n, k)), code=_nf4_code_bnb(w.device),
                       blocksize=BLOCKSIZE, quant_type="nf4", dtype=w.dtype,
                       offset=w.offset[e] if w.double_quant else None, state2=state2)
    return w.packed[e].view(-1, 1), state


def from_bnb(items) -> NF4Weight:
    """Stack per-expert bitsandbytes NF4 tensors [(packed, QuantState), ...] (e.g. from a per-expert pre-quantized
    checkpoint) into one NF4Weight [E, N, K]. Every expert must have the same shape (N, K), dtype, blocksize 64,
    quant_type "nf4", and either all or none double-quantized (blocksize 256, one shared nested code)."""
    items = list(items)
    if not items:
        raise InvalidArgumentError("from_bnb needs at least one (packed, QuantState) pair")
    first = items[0][1]
    packed, absmax, nested_absmax, offsets = [], [], [], []
    for e, item in enumerate(items):
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise InvalidArgumentError(f"from_bnb: item {e} must be a (packed, QuantState) pair, got {type(item)}")
        data, state = item
        where = f"from_bnb: expert {e}"
        if state.quant_type != "nf4":
            raise InvalidArgumentError(f"{where} has quant_type {state.quant_type!r}; moegraph stores NF4 only "
                                       f"(FP4 is not supported): quantize with quant_type='nf4'")
        if state.blocksize != BLOCKSIZE:
            raise InvalidArgumentError(f"{where} has blocksize {state.blocksize}; moegraph's format needs "
                                       f"{BLOCKSIZE}: quantize with blocksize={BLOCKSIZE}")
        shape = tuple(state.shape) if state.shape is not None else None
        if shape is None or len(shape) != 2:
            raise InvalidArgumentError(f"{where} has shape {shape}; each expert must be one matrix (N, K)")
        if shape != tuple(first.shape) or state.dtype != first.dtype:
            raise InvalidArgumentError(f"{where} is {shape} {state.dtype}, expert 0 is {tuple(first.shape)} "
                                       f"{first.dtype}: all experts must match")
        if state.nested != first.nested:
            raise InvalidArgumentError(f"{where} is {'' if state.nested else 'not '}double-quantized, expert 0 "
                                       f"is{'' if first.nested else ' not'}: all experts must match")
        check_nf4_shape((1, *shape))
        code = state.code if state.code is not None else _nf4_code_bnb(data.device)
        if not torch.equal(code.detach().float().cpu(), nf4_code()):
            raise InvalidArgumentError(f"{where}: its 4-bit code is not bnb's NF4 table")
        data = data.detach().contiguous()
        if data.dtype != torch.uint8:  # bnb's quant_storage: the same bytes under another dtype
            data = data.view(torch.uint8)
        if data.numel() != shape[0] * shape[1] // 2:
            raise InvalidArgumentError(f"{where}: packed has {data.numel()} bytes, shape {shape} needs "
                                       f"{shape[0] * shape[1] // 2}")
        packed.append(data.reshape(-1))
        absmax.append(state.absmax.reshape(-1))
        if state.nested:
            if state.state2.blocksize != NESTED_BLOCKSIZE:
                raise InvalidArgumentError(f"{where}: nested blocksize {state.state2.blocksize}, moegraph "
                                           f"needs {NESTED_BLOCKSIZE} (bnb's compress_statistics default)")
            if not torch.equal(state.state2.code.to(first.state2.code.device), first.state2.code):
                raise InvalidArgumentError(f"{where}: its nested code differs from expert 0's; one shared code "
                                           f"is needed")
            nested_absmax.append(state.state2.absmax.reshape(-1))
            offsets.append(torch.as_tensor(state.offset, dtype=torch.float32, device=data.device).reshape(()))
    try:
        stacked = dict(packed=torch.stack(packed), absmax=torch.stack(absmax))
        if first.nested:
            stacked.update(nested_absmax=torch.stack(nested_absmax).float(), offset=torch.stack(offsets),
                           nested_code=first.state2.code.detach().float().clone().to(stacked["packed"].device))
    except RuntimeError as error:  # devices differ
        raise InvalidArgumentError(f"from_bnb: the experts' tensors cannot be stacked: {error}") from None
    return NF4Weight(shape=(len(items), *first.shape), dtype=first.dtype, **stacked)
