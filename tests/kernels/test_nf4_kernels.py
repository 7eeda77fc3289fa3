"""NF4 kernels (nf4_gemv, nf4_moe) against their plain-torch references, and the layout against bitsandbytes.

Shapes x compute dtype x (plain or nested absmax) x (tensor-core or multiply-add path), fresh random data.
On the CPU the kernels run in Triton's interpreter, whose float32 -> bfloat16 cast truncates instead of
rounding to nearest even: bf16 is checked loosely against the reference there, and exactly against the
reference computed with the interpreter's rounding (test_bf16_is_exact_under_interpreter_rounding).
"""

from dataclasses import replace

import pytest
import torch

from moegraph.errors import InvalidArgumentError
from moegraph.kernels import triton_available
from moegraph.kernels import _nf4 as nf4_internals
from moegraph.kernels._nf4 import _nf4_matmul, resolve_lookup
from moegraph.kernels._triton import tl, triton
from moegraph.kernels.moe_combine import moe_combine
from moegraph.kernels.nf4_gemv import (NF4LinearConfig, nf4_add_rms_norm_linear_group, nf4_linear, nf4_linear_group,
                                       nf4_linear_ref)
from moegraph.kernels.rms_norm import add_rms_norm, rms_norm
from moegraph.kernels.nf4_moe import (NF4_CODE, NF4MoEConfig, NF4Tensors, dequantize_nf4_ref, fused_moe_experts_nf4,
                                      fused_moe_experts_nf4_ref, nf4_code)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not triton_available(torch.empty(0, device=DEVICE)), reason="Triton cannot run here")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# relative L2 error allowed: fp32 and fp16 differ from the reference only by float32 summation order (and
# a rare 1-ulp flip of a rounded intermediate); bf16 on the CPU carries the interpreter's truncation
TILES = dict(gate_up_block_n=32, down_block_n=64)  # fewer interpreter programs than the defaults, same code
# (fp16 on the GPU: a 1-ulp flip of a rounded gate/up/silu value in a tiny [1, 64] output is ~2e-4 of it alone)
REL_TOL = {torch.float32: 1e-5, torch.float16: 1e-3 if DEVICE == "cuda" else 2e-4,
           torch.bfloat16: 1e-2 if DEVICE == "cuda" else 6e-2}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _random_nf4(experts, rows, cols, nested, seed):
    """Random bytes, positive absmax (never zeros); `experts` None gives one (N, K) weight like Linear4bit's."""
    gen = _gen(seed)
    e = experts or 1
    nblocks = -(-rows * cols // 64)
    packed = torch.randint(0, 256, (e, rows * cols // 2), dtype=torch.uint8, generator=gen)
    shape = (rows, cols) if experts is None else (e, rows, cols)
    if experts is None:
        packed = packed.view(-1, 1)  # Linear4bit's weight.data shape
    if not nested:
        absmax = (torch.rand(e, nblocks, generator=gen) + 0.2) * 0.1
        return NF4Tensors(packed.to(DEVICE), (absmax.view(-1) if experts is None else absmax).to(DEVICE), shape)
    absmax_q = torch.randint(0, 256, (e, nblocks), dtype=torch.uint8, generator=gen)
    nested_code = torch.randn(256, generator=gen) * 0.05
    nested_absmax = torch.rand(e, -(-nblocks // 256), generator=gen) + 0.5
    offset = torch.rand(e, generator=gen) * 0.05 + 0.05
    if experts is None:
        absmax_q, nested_absmax, offset = absmax_q.view(-1), nested_absmax.view(-1), offset.view(())
    return NF4Tensors(packed.to(DEVICE), absmax_q.to(DEVICE), shape, nested_code.to(DEVICE), nested_absmax.to(DEVICE),
                      offset.to(DEVICE))


def _rel(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _linear_args(w: NF4Tensors):
    return dict(nested_code=w.nested_code, nested_absmax=w.nested_absmax, offset=w.offset)


@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows_m, n, k, bias", [(1, 32, 128, False), (3, 48, 96, True)])
def test_nf4_linear(use_dot, nested, dtype, rows_m, n, k, bias):
    """K = 96 puts 64-blocks across rows; block_k 64 makes both K two steps, split over two programs."""
    w = _random_nf4(None, n, k, nested, seed=rows_m * n + k)
    x = torch.randn(rows_m, k, generator=_gen(1)).to(DEVICE, dtype)
    b = torch.randn(n, generator=_gen(2)).to(DEVICE, dtype) if bias else None
    code = nf4_code(DEVICE)
    config = NF4LinearConfig(use_dot=use_dot, block_n=32, block_k=64)
    got = nf4_linear(x, w.packed, w.absmax, code, n, k, b, config=config, **_linear_args(w))
    want = nf4_linear_ref(x, w.packed, w.absmax, code, n, k, b, config=config, **_linear_args(w))
    assert _rel(got, want) < REL_TOL[dtype]


@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("low_nibble", [False, True])
def test_nf4_linear_reads_high_nibble_first(use_dot, low_nibble):
    """All weights 0 (index 7) but one: byte j of row 5 holds W[5, 2j] high, W[5, 2j + 1] low."""
    n, k, row, byte, q = 32, 128, 5, 19, 13
    packed = torch.full((n * k // 2,), 0x77, dtype=torch.uint8)
    packed[row * k // 2 + byte] = (0x70 | q) if low_nibble else ((q << 4) | 0x7)
    absmax = torch.full((n * k // 64,), 0.5)
    x = torch.arange(1, k + 1, dtype=torch.float32)[None, :]  # x[0, c] = c + 1 tells which column was read
    got = nf4_linear(x.to(DEVICE), packed.to(DEVICE), absmax.to(DEVICE), nf4_code(DEVICE), n, k,
                     config=NF4LinearConfig(use_dot=use_dot, block_n=32, block_k=64)).cpu()
    want = torch.zeros(1, n)
    want[0, row] = NF4_CODE[q] * 0.5 * (2 * byte + int(low_nibble) + 1)
    assert torch.equal(got, want), (got[0, row], want[0, row])


def test_nf4_linear_split_k_is_deterministic():
    n, k = 48, 512
    w = _random_nf4(None, n, k, nested=False, seed=3)
    x = torch.randn(2, k, generator=_gen(4)).to(DEVICE, torch.float16)
    code = nf4_code(DEVICE)
    split = [nf4_linear(x, w.packed, w.absmax, code, n, k, config=NF4LinearConfig(block_k=64, split_k=4))
             for _ in range(2)]
    whole = nf4_linear(x, w.packed, w.absmax, code, n, k, config=NF4LinearConfig(block_k=64, split_k=1))
    assert torch.equal(split[0], split[1])
    assert _rel(split[0], whole) < REL_TOL[torch.float16]


@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_nf4_linear_group_equals_one_launch_per_weight(use_dot, nested, bias):
    """q, k, v in one launch: each output equal, bit for bit, to nf4_linear of that weight (and its bias, as
    Qwen2-MoE's q/k/v have) without a K split."""
    k = 128
    weights = [_random_nf4(None, n, k, nested, seed=50 + n) for n in (32, 16, 48)]
    x = torch.randn(3 if use_dot else 1, k, generator=_gen(51)).to(DEVICE, torch.float16)
    biases = [torch.randn(w.shape[0], generator=_gen(53 + i)).to(DEVICE, torch.float16)
              for i, w in enumerate(weights)] if bias else None
    code = nf4_code(DEVICE)
    config = NF4LinearConfig(use_dot=use_dot, block_n=16 if not use_dot else 32, block_k=64)
    got = nf4_linear_group(x, weights, code, config, biases=biases)
    for i, (g, w) in enumerate(zip(got, weights)):
        want = nf4_linear(x, w.packed, w.absmax, code, w.shape[0], k, biases[i] if bias else None,
                          config=replace(config, split_k=1), **_linear_args(w))
        assert torch.equal(g, want)
    with pytest.raises(InvalidArgumentError, match="one K"):
        nf4_linear_group(x, [weights[0], _random_nf4(None, 16, 64, nested, seed=52)], code)
    if bias:
        with pytest.raises(InvalidArgumentError, match="one tensor per weight"):
            nf4_linear_group(x, weights, code, config, biases=biases[:2])
        with pytest.raises(InvalidArgumentError, match="bias must be"):
            nf4_linear_group(x, weights, code, config, biases=[biases[1], biases[1], biases[2]])


@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("add", [True, False])
@pytest.mark.parametrize("lookup", [1, 5])
def test_add_rms_norm_in_front_of_the_nf4_group(monkeypatch, use_dot, nested, add, lookup):
    """The norm before attention inside the NF4 q/k/v GEMV: the summed residual exactly, and each projection the
    norm kernel followed by the group (bit for bit where the sums run in the same order: the interpreter). With
    the words lookup (5) one row reads a normalized copy of itself (NORMED_SCRATCH), so the group behind the norm
    kernel runs the words lookup too."""
    from moegraph.kernels import nf4_gemv

    scratch = []
    kernel = nf4_gemv._nf4_linear_group_kernel

    class Recorded:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: scratch.append(kwargs["NORMED_SCRATCH"]) or kernel[grid](*args, **kwargs)

    monkeypatch.setattr(nf4_gemv, "_nf4_linear_group_kernel", Recorded())
    k, dtype = 128, torch.float16
    rows = 3 if use_dot else 1
    weights = [_random_nf4(None, n, k, nested, seed=60 + n) for n in (32, 16, 48)]
    residual = torch.randn(rows, k, generator=_gen(61)).to(DEVICE, dtype)
    x = torch.randn(rows, k, generator=_gen(62)).to(DEVICE, dtype) if add else None
    norm_weight = (1 + 0.1 * torch.randn(k, generator=_gen(63))).to(DEVICE, dtype)
    code = nf4_code(DEVICE)
    config = NF4LinearConfig(use_dot=use_dot, block_n=16 if not use_dot else 32, block_k=64, lookup=lookup)
    summed, outs = nf4_add_rms_norm_linear_group(residual, x, norm_weight, 1e-6, weights, code, config)
    if add:
        want_summed, hidden = add_rms_norm(residual, x, norm_weight, 1e-6)
        assert torch.equal(summed, want_summed)
    else:
        hidden = rms_norm(residual, norm_weight, 1e-6)
        assert summed is residual
    assert scratch == [lookup == 5 and not use_dot]  # one row behind the norm: the words lookup on its copy
    for got, want in zip(outs, nf4_linear_group(hidden, weights, code, config)):
        if DEVICE == "cpu":
            assert torch.equal(got, want)
        assert _rel(got, want) < REL_TOL[dtype]
    with pytest.raises(InvalidArgumentError, match="norm weight"):
        nf4_add_rms_norm_linear_group(residual, x, norm_weight.float(), 1e-6, weights, code, config)


@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("dtype, tokens, inter", [(torch.float16, 1, 32), (torch.bfloat16, 1, 32)] +
                         [(dtype, 5, 64) for dtype in DTYPES])
def test_fused_moe_experts_nf4(use_dot, nested, dtype, tokens, inter):
    """E = 4, top-2 over experts 0..2 (expert 3 never routed); I = 32 puts the down projection's 64-blocks
    across rows, I = 64 keeps them in rows."""
    experts, hidden, top_k = 4, 64, 2
    gate_up = _random_nf4(experts, 2 * inter, hidden, nested, seed=10 + tokens)
    down = _random_nf4(experts, hidden, inter, nested, seed=20 + tokens)
    gen = _gen(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    index = torch.rand(tokens, experts - 1, generator=gen).topk(top_k, dim=-1).indices.to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE, dtype)
    code = nf4_code(DEVICE)
    config = NF4MoEConfig(use_dot=use_dot, **TILES)
    got = fused_moe_experts_nf4(x, index, weights, gate_up, down, code, moe_combine, config)
    want = fused_moe_experts_nf4_ref(x, index, weights, gate_up, down, code, config=config)
    assert _rel(got, want) < REL_TOL[dtype]


@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("lookup", [0, 1, 2, 3, 4, 5])
def test_every_code_lookup(lookup, use_dot):
    """The forms of the 16-entry code table (L1 gather, shared 16 values gathered per nibble or for both at once,
    shared 256 byte pairs, warp shuffles per nibble or a word at a time: on CUDA only, 1 elsewhere) agree."""
    code = nf4_code(DEVICE)
    w = _random_nf4(None, 48, 128, True, seed=40)
    x = torch.randn(3, 128, generator=_gen(41)).to(DEVICE, torch.float16)
    config = NF4LinearConfig(use_dot=use_dot, lookup=lookup)
    got = nf4_linear(x, w.packed, w.absmax, code, 48, 128, config=config, **_linear_args(w))
    assert _rel(got, nf4_linear_ref(x, w.packed, w.absmax, code, 48, 128, config=config, **_linear_args(w))) < 2e-4
    gate_up, down = _random_nf4(4, 128, 64, False, seed=42), _random_nf4(4, 64, 64, False, seed=43)
    x = torch.randn(3, 64, generator=_gen(44)).to(DEVICE, torch.float16)
    index = torch.rand(3, 3, generator=_gen(45)).topk(2, dim=-1).indices.to(DEVICE)
    weights = torch.rand(3, 2, generator=_gen(46)).to(DEVICE, torch.float16)
    config = NF4MoEConfig(use_dot=use_dot, lookup=lookup, **TILES)
    got = fused_moe_experts_nf4(x, index, weights, gate_up, down, code, moe_combine, config)
    assert _rel(got, fused_moe_experts_nf4_ref(x, index, weights, gate_up, down, code, config=config)) < 2e-4


@pytest.mark.skipif(DEVICE != "cuda", reason="LOOKUP 4 is PTX; elsewhere both launches run LOOKUP 1")
@pytest.mark.parametrize("x_pairs", [False, True])
@pytest.mark.parametrize("nested", [False, True])
def test_shuffle_lookup_gives_the_same_bits(nested, x_pairs):
    """LOOKUP 4 reads the same float32 code values by warp shuffles instead of shared memory: everything after the
    lookup is the same, so the outputs equal LOOKUP 1's bit for bit, one row and several, GEMV, q/k/v group with
    the norm, experts."""
    code = nf4_code(DEVICE)
    w = _random_nf4(None, 64, 256, nested, seed=80)
    for rows in (1, 3):
        x = torch.randn(rows, 256, generator=_gen(81)).to(DEVICE, torch.bfloat16)
        runs = [nf4_linear(x, w.packed, w.absmax, code, 64, 256, config=NF4LinearConfig(
            use_dot=False, lookup=lookup, x_pairs=x_pairs), **_linear_args(w)) for lookup in (1, 4)]
        assert torch.equal(runs[0], runs[1])
    norm_weight = torch.rand(256, generator=_gen(82)).to(DEVICE, torch.bfloat16) + 0.5
    normed = [nf4_add_rms_norm_linear_group(x[:1], x[:1], norm_weight, 1e-6, [w, w], code, NF4LinearConfig(
        lookup=lookup, x_pairs=x_pairs))[1] for lookup in (1, 4)]
    assert all(torch.equal(a, b) for a, b in zip(*normed))
    gate_up, down = _random_nf4(4, 128, 128, nested, seed=83), _random_nf4(4, 128, 64, nested, seed=84)
    for tokens in (1, 3):
        x = torch.randn(tokens, 128, generator=_gen(85)).to(DEVICE, torch.bfloat16)
        index = torch.rand(tokens, 4, generator=_gen(86)).topk(2, dim=-1).indices.to(DEVICE)
        weights = torch.rand(tokens, 2, generator=_gen(87)).to(DEVICE, torch.bfloat16)
        runs = [fused_moe_experts_nf4(x, index, weights, gate_up, down, code, moe_combine, NF4MoEConfig(
            use_dot=False, gate_up_block_n=16, down_block_n=16, block_k=128, lookup=lookup, x_pairs=x_pairs))
            for lookup in (1, 4)]
        assert torch.equal(runs[0], runs[1])


@triton.jit
def _rows_dot_kernel(x_ptr, w_ptr, absmax_ptr, code_ptr, out_ptr, n, row_bytes, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, LOOKUP: tl.constexpr):
    """out[r] = W[r] . x[0] in float32 (the multiply-add path of _nf4_matmul, unrounded), BLOCK_N rows a program."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nested = absmax_ptr  # not nested: never read
    acc, _ = _nf4_matmul(x_ptr, tl.program_id(0) * 0, True, w_ptr, absmax_ptr, nested, nested, nested, code_ptr,
                         rows, rows, rows < n, 0, row_bytes, row_bytes, tl.float32, 1, BLOCK_N, BLOCK_K, False, False,
                         True, False, False, LOOKUP, False)
    tl.store(out_ptr + rows, acc, mask=rows < n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_words_lookup_sums_a_word_first(dtype):
    """LOOKUP 5 before any rounding: float32 row sums within float32 summation error of LOOKUP 1's, and not its bits
    (each word's 8 products are summed first), with the row end mid-step (K 192 in steps of 128: the last step's
    tail words masked)."""
    n, k = 40, 192
    w = _random_nf4(None, n, k, False, seed=97)
    x = torch.randn(1, k, generator=_gen(98)).to(DEVICE, dtype)
    code = nf4_code(DEVICE)
    sums = {}
    for lookup in (1, 5):
        sums[lookup] = torch.empty(n, dtype=torch.float32, device=DEVICE)
        _rows_dot_kernel[(triton.cdiv(n, 8),)](x, w.packed, w.absmax, code, sums[lookup], n, k // 2, BLOCK_N=8,
                                               BLOCK_K=128, LOOKUP=resolve_lookup(lookup, x, w.packed))
    want = dequantize_nf4_ref(w, code, torch.float32).double() @ x[0].double()
    for lookup in (1, 5):
        assert (sums[lookup].double() - want).abs().max() < 1e-5 * want.abs().max()
    assert not torch.equal(sums[1], sums[5])


@pytest.mark.parametrize("dtype, nested", [(torch.bfloat16, False), (torch.float16, True)])
def test_words_lookup_against_the_reference(dtype, nested):
    """LOOKUP 5 (a word of 8 weights a time; on the CPU its asm emulated in Triton ops) through the launchers: the
    GEMV with the row end mid-step, the experts at one token and at three (gate and up in one loop, down), against
    the references (fp16: a rounded gate / up / silu value may flip by an ulp, as on the GPU)."""
    tol = max(REL_TOL[dtype], 1e-3)
    code = nf4_code(DEVICE)
    w = _random_nf4(None, 40, 192, nested, seed=90)
    x = torch.randn(2, 192, generator=_gen(91)).to(DEVICE, dtype)
    got = nf4_linear(x, w.packed, w.absmax, code, 40, 192, config=NF4LinearConfig(
        use_dot=False, block_n=8, block_k=128, lookup=5), **_linear_args(w))
    assert _rel(got, nf4_linear_ref(x, w.packed, w.absmax, code, 40, 192, **_linear_args(w))) < tol
    gate_up, down = _random_nf4(4, 64, 128, nested, seed=92), _random_nf4(4, 128, 32, nested, seed=93)
    # gate_up's steps wider than down's (ONE_TOKEN_BLOCK_K's form), here wider than the row too
    for tokens, block_k, down_block_k in ((1, 128, None), (3, 128, None), (1, 256, 64)):
        x = torch.randn(tokens, 128, generator=_gen(94)).to(DEVICE, dtype)
        index = torch.rand(tokens, 4, generator=_gen(95)).topk(2, dim=-1).indices.to(DEVICE)
        weights = torch.rand(tokens, 2, generator=_gen(96)).to(DEVICE, dtype)
        config = NF4MoEConfig(use_dot=False, gate_up_block_n=16, down_block_n=32, block_k=block_k,
                              down_block_k=down_block_k, lookup=5)
        got = fused_moe_experts_nf4(x, index, weights, gate_up, down, code, moe_combine, config)
        want = fused_moe_experts_nf4_ref(x, index, weights, gate_up, down, code, config=config)
        assert _rel(got, want) < tol, (tokens, block_k, down_block_k)


def test_words_lookup_in_every_launcher_form():
    """LOOKUP 5 where the launchers cut the work otherwise: rows past N in the last tile, split-K, the grouped q/k/v
    GEMV (three weights in one launch), the down GEMVs with the combine in one launch; each against LOOKUP 1 (fp16:
    the same sums up to float32 order, well inside one fp16 rounding here)."""
    code = nf4_code(DEVICE)
    w = _random_nf4(None, 44, 256, False, seed=100)
    x = torch.randn(1, 256, generator=_gen(101)).to(DEVICE, torch.float16)

    def both(call):
        return [call(lookup) for lookup in (1, 5)]

    for cfg in (dict(block_n=8), dict(block_n=16, split_k=2)):
        a, b = both(lambda lookup: nf4_linear(x, w.packed, w.absmax, code, 44, 256, config=NF4LinearConfig(
            use_dot=False, block_k=64, lookup=lookup, **cfg)))
        assert _rel(b, a) < 2e-4, cfg
    group = [_random_nf4(None, n, 256, True, seed=102 + n) for n in (12, 20)]
    a, b = both(lambda lookup: nf4_linear_group(x, group, code, NF4LinearConfig(block_n=8, lookup=lookup)))
    assert all(_rel(o5, o1) < 2e-4 for o1, o5 in zip(a, b))
    gate_up, down = _random_nf4(4, 64, 128, False, seed=110), _random_nf4(4, 128, 32, False, seed=111)
    x = torch.randn(2, 128, generator=_gen(112)).to(DEVICE, torch.float16)
    index = torch.rand(2, 4, generator=_gen(113)).topk(2, dim=-1).indices.to(DEVICE)
    weights = torch.rand(2, 2, generator=_gen(114)).to(DEVICE, torch.float16)
    a, b = both(lambda lookup: fused_moe_experts_nf4(x, index, weights, gate_up, down, code, moe_combine, NF4MoEConfig(
        use_dot=False, gate_up_block_n=16, down_block_n=32, block_k=128, lookup=lookup, combine=True)))
    assert _rel(b, a) < 2e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_words_sharing_x_give_the_same_values(monkeypatch, dtype):
    """SHARED_X (two words of the same columns against one x load: gate with up, rows 2i with 2i + 1): the one-row
    GEMV with rows past N in the last tile and split-K, the grouped q/k/v GEMV, the experts at one token and at
    three. Interpreted (the asm's arithmetic emulated, the row pairing real) the same bits; on a GPU a tile of half
    the rows may sum a row's words in another order: float32 summation error, and a rare flip of a rounding."""
    from moegraph.kernels import nf4_gemv, nf4_moe
    code = nf4_code(DEVICE)
    w = _random_nf4(None, 44, 256, False, seed=120)
    group = [_random_nf4(None, n, 256, True, seed=121 + n) for n in (12, 20)]
    x = torch.randn(1, 256, generator=_gen(122)).to(DEVICE, dtype)
    gate_up, down = _random_nf4(4, 64, 128, True, seed=123), _random_nf4(4, 128, 32, False, seed=124)
    hidden = torch.randn(3, 128, generator=_gen(125)).to(DEVICE, dtype)
    index = torch.rand(3, 4, generator=_gen(126)).topk(2, dim=-1).indices.to(DEVICE)
    weights = torch.rand(3, 2, generator=_gen(127)).to(DEVICE, dtype)
    moe_config = NF4MoEConfig(use_dot=False, gate_up_block_n=16, down_block_n=32, block_k=128, lookup=5)

    def outputs():
        return ([nf4_linear(x, w.packed, w.absmax, code, 44, 256, config=NF4LinearConfig(
                    use_dot=False, block_k=64, lookup=5, **cfg)) for cfg in (dict(block_n=8), dict(block_n=16,
                                                                                                split_k=2))]
                + nf4_linear_group(x, group, code, NF4LinearConfig(block_n=8, lookup=5))
                + [fused_moe_experts_nf4(hidden[:t], index[:t], weights[:t], gate_up, down, code, moe_combine,
                                         moe_config) for t in (1, 3)])

    got = {}
    for shared in (False, True):
        monkeypatch.setattr(nf4_gemv, "SHARED_X", shared)
        monkeypatch.setattr(nf4_moe, "SHARED_X", shared)
        got[shared] = outputs()
    for alone, paired in zip(got[False], got[True]):
        assert torch.equal(alone, paired) if DEVICE == "cpu" else _rel(paired, alone) < REL_TOL[dtype]
    assert _rel(got[True][0], nf4_linear_ref(x, w.packed, w.absmax, code, 44, 256)) < REL_TOL[dtype] * 10


def test_shuffle_lookup_runs_only_where_its_ptx_does(monkeypatch):
    """LOOKUP 4 is PTX: off CUDA and under Triton's interpreter the launch takes LOOKUP 1 (the same values). LOOKUP 5
    runs on CUDA and interpreted (its asm emulated); it needs x on 16 bytes and the weight bytes on 4 (its loads),
    else it runs as 4 (as 1 where 4 cannot run)."""

    class At:  # what resolve_lookup reads of a tensor: its device and address
        def __init__(self, device, address):
            self.device, self.address = torch.device(device), address

        def data_ptr(self):
            return self.address

    monkeypatch.setattr(nf4_internals, "_EMULATE_PTX", tl.constexpr(False))
    assert resolve_lookup(4, At("cuda", 0), At("cuda", 0)) == 4
    assert resolve_lookup(5, At("cuda", 0), At("cuda", 0), At("cuda", 4)) == 5
    assert resolve_lookup(5, At("cuda", 8), At("cuda", 0)) == 4  # x a view 8 bytes in: its 16-byte loads
    assert resolve_lookup(5, At("cuda", 0), At("cuda", 0), At("cuda", 2)) == 4
    assert resolve_lookup(4, At("cpu", 0), At("cpu", 0)) == 1 and resolve_lookup(5, At("cpu", 0), At("cpu", 0)) == 1
    assert resolve_lookup(3, At("cpu", 0), At("cpu", 0)) == 3
    monkeypatch.setattr(nf4_internals, "_EMULATE_PTX", tl.constexpr(True))
    assert resolve_lookup(4, At("cuda", 0), At("cuda", 0)) == 1
    assert resolve_lookup(5, At("cpu", 0), At("cpu", 0)) == 5
    assert resolve_lookup(5, At("cpu", 8), At("cpu", 0)) == 1


@pytest.mark.parametrize("dtype, block_n", [(torch.float16, 8), (torch.bfloat16, 2), (torch.float32, 8)])
def test_x_read_as_pairs_gives_the_same_bits(dtype, block_n):
    """x_pairs (16-bit x read as 32-bit pairs in the weight tile's layout) changes how x reaches the products, not
    the products or their order: the outputs equal the default loads' bit for bit, for the NF4 GEMV (plain and
    with the norm in front, which keeps the 1-D loads) and the experts; float32 x ignores it. block_n 2: the thin
    tiles of the dense pair GEMV (kernels/fused_moe.py) are allowed on the multiply-add path."""
    code = nf4_code(DEVICE)
    w = _random_nf4(None, 16, 192, False, seed=70)
    x = torch.randn(1, 192, generator=_gen(71)).to(DEVICE, dtype)
    runs = [nf4_linear(x, w.packed, w.absmax, code, 16, 192, config=NF4LinearConfig(
        use_dot=False, block_n=block_n, block_k=128, x_pairs=pairs)) for pairs in (False, True)]
    assert torch.equal(runs[0], runs[1])
    assert _rel(runs[1], nf4_linear_ref(x, w.packed, w.absmax, code, 16, 192)) < REL_TOL[dtype]
    norm_weight = torch.rand(192, generator=_gen(72)).to(DEVICE, dtype) + 0.5
    normed = [nf4_add_rms_norm_linear_group(x, x, norm_weight, 1e-6, [w], code, NF4LinearConfig(
        use_dot=False, block_n=block_n, block_k=128, x_pairs=pairs))[1][0] for pairs in (False, True)]
    assert torch.equal(normed[0], normed[1])
    gate_up, down = _random_nf4(4, 64, 64, False, seed=73), _random_nf4(4, 64, 32, False, seed=74)
    x = torch.randn(3, 64, generator=_gen(75)).to(DEVICE, dtype)
    index = torch.rand(3, 3, generator=_gen(76)).topk(2, dim=-1).indices.to(DEVICE)
    weights = torch.rand(3, 2, generator=_gen(77)).to(DEVICE, dtype)
    block_n = max(block_n, 8)  # the experts' few-token tiles (2-row tiles: 6x the interpreter's programs)
    runs = [fused_moe_experts_nf4(x, index, weights, gate_up, down, code, moe_combine, NF4MoEConfig(
        use_dot=False, gate_up_block_n=block_n, down_block_n=block_n, block_k=64, x_pairs=pairs))
        for pairs in (False, True)]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's default tiles; on a GPU a tile's layout may order a sum")
@pytest.mark.parametrize("tokens", [1, 3])
def test_interpreter_tiles_give_the_gpu_tiles_bits(tokens):
    """Under the interpreter the multiply-add path takes INTERPRETER_BLOCK_N-row tiles by default (fewer Python
    programs); each row's sum runs as in the GPU's thin tiles, so the bits are the same."""
    from moegraph.kernels import nf4_moe

    code = nf4_code(DEVICE)
    gate_up, down = _random_nf4(4, 128, 64, False, seed=85), _random_nf4(4, 64, 64, False, seed=86)
    x = torch.randn(tokens, 64, generator=_gen(87)).to(DEVICE, torch.bfloat16)
    index = torch.rand(tokens, 4, generator=_gen(88)).topk(2, dim=-1).indices.to(DEVICE)
    weights = torch.rand(tokens, 2, generator=_gen(89)).to(DEVICE, torch.bfloat16)
    gpu_tiles = nf4_moe._default_block_n(tokens, use_dot=False)
    runs = [fused_moe_experts_nf4(x, index, weights, gate_up, down, code, moe_combine, NF4MoEConfig(
        use_dot=False, gate_up_block_n=block_n[0], down_block_n=block_n[1]))
        for block_n in ((None, None), gpu_tiles)]
    assert torch.equal(runs[0], runs[1])


def test_few_tokens_and_one_token_take_their_own_defaults(monkeypatch):
    """2-15 tokens default to FEW_TOKENS_LOOKUP / FEW_TOKENS_X_PAIRS / FEW_TOKENS_NUM_WARPS, one token to LOOKUP /
    X_PAIRS / ONE_TOKEN_NUM_WARPS (the words lookup in 8 warps, measured faster on the H100); a config's own choice
    wins. LOOKUP 1 and 3 give the same bits."""
    from moegraph.kernels import nf4_moe

    launched = []
    launch = nf4_moe._launch
    monkeypatch.setattr(nf4_moe, "_launch", lambda *a, **k: launched.append(a[9]) or launch(*a, **k))
    code = nf4_code(DEVICE)
    gate_up, down = _random_nf4(4, 64, 64, False, seed=80), _random_nf4(4, 64, 32, False, seed=81)
    x = torch.randn(3, 64, generator=_gen(82)).to(DEVICE, torch.bfloat16)
    index = torch.rand(3, 4, generator=_gen(83)).topk(2, dim=-1).indices.to(DEVICE)
    weights = torch.rand(3, 2, generator=_gen(84)).to(DEVICE, torch.bfloat16)
    run = lambda t, cfg: fused_moe_experts_nf4(x[:t], index[:t], weights[:t], gate_up, down, code,  # noqa: E731
                                               moe_combine, cfg)
    for tokens, want in ((3, (nf4_moe.FEW_TOKENS_LOOKUP, nf4_moe.FEW_TOKENS_X_PAIRS, nf4_moe.FEW_TOKENS_NUM_WARPS)),
                         (1, (nf4_moe.LOOKUP, nf4_moe.X_PAIRS, nf4_moe.ONE_TOKEN_NUM_WARPS))):
        launched.clear()
        run(tokens, NF4MoEConfig(block_k=64))
        assert {(cfg.lookup, cfg.x_pairs, cfg.num_warps) for cfg in launched} == {want}
        launched.clear()
        one_gather = run(tokens, NF4MoEConfig(block_k=64, lookup=3, x_pairs=True))
        assert {(cfg.lookup, cfg.x_pairs) for cfg in launched} == {(3, True)}
        assert torch.equal(one_gather, run(tokens, NF4MoEConfig(block_k=64, lookup=1, x_pairs=False)))
    assert (nf4_moe.LOOKUP, nf4_moe.FEW_TOKENS_LOOKUP, nf4_moe.FEW_TOKENS_X_PAIRS) == (5, 5, True)
    assert (nf4_moe.ONE_TOKEN_NUM_WARPS, nf4_moe.FEW_TOKENS_NUM_WARPS) == (8, 8)


def test_x_pairs_only_where_the_words_are_aligned():
    """A view that starts mid-word (its 32-bit pair loads would be misaligned on a GPU) keeps the 1-D loads."""
    from moegraph.kernels._nf4 import pairs_readable

    words = torch.zeros(1, 66, dtype=torch.bfloat16, device=DEVICE)
    assert pairs_readable(words[:, :64], True) and not pairs_readable(words[:, :64], False)
    assert not pairs_readable(words.view(-1)[1:65].view(1, 64), True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3])
def test_down_and_combine_in_one_launch_give_the_same_bits(dtype, tokens):
    """combine=True (the multiply-add path's down GEMVs and moe_combine in one launch) equals the two launches bit
    for bit; the module's PAIR_COMBINE is the default of a config that leaves it None."""
    from moegraph.kernels import nf4_moe

    gate_up, down = _random_nf4(4, 64, 64, False, seed=80), _random_nf4(4, 64, 32, False, seed=81)
    x = torch.randn(tokens, 64, generator=_gen(82)).to(DEVICE, dtype)
    index = torch.rand(tokens, 3, generator=_gen(83)).topk(2, dim=-1).indices.to(DEVICE)
    weights = torch.rand(tokens, 2, generator=_gen(84)).to(DEVICE, dtype)
    code = nf4_code(DEVICE)
    run = lambda **cfg: fused_moe_experts_nf4(x, index, weights, gate_up, down, code, moe_combine,  # noqa: E731
                                              NF4MoEConfig(use_dot=False, block_k=64, **cfg))
    apart, together = run(combine=False), run(combine=True)
    assert together.dtype == dtype and torch.equal(together, apart)
    keep = nf4_moe.PAIR_COMBINE
    nf4_moe.PAIR_COMBINE = True
    try:
        launches = []
        kernel = nf4_moe._down_combine_nf4_kernel
        nf4_moe._down_combine_nf4_kernel = type("Counted", (), {"__getitem__": lambda self, grid: (
            launches.append(grid), kernel[grid])[1]})()
        assert torch.equal(run(), apart) and len(launches) == 1
    finally:
        nf4_moe.PAIR_COMBINE = keep
        nf4_moe._down_combine_nf4_kernel = kernel


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's bf16 rounding only")
def test_bf16_is_exact_under_interpreter_rounding(monkeypatch):
    """With the references' float32 -> bf16 casts truncating like the interpreter's, the kernels match exactly:
    what the loose bf16 tolerance above hides is that rounding and nothing else."""
    to = torch.Tensor.to

    def truncating_to(self, *args, **kwargs):
        if args and args[0] is torch.bfloat16 and self.dtype == torch.float32 and not kwargs:
            return to(self.contiguous().view(torch.int32).bitwise_and(-65536).view(torch.float32), torch.bfloat16)
        return to(self, *args, **kwargs)

    code = nf4_code(DEVICE)
    gate_up, down = _random_nf4(4, 64, 64, True, seed=30), _random_nf4(4, 64, 32, True, seed=31)  # I = 32, T = 3
    x = torch.randn(3, 64, generator=_gen(5)).to(torch.bfloat16)
    index = torch.rand(3, 3, generator=_gen(6)).topk(2, dim=-1).indices
    weights = torch.rand(3, 2, generator=_gen(7)).to(torch.bfloat16)
    w = _random_nf4(None, 48, 96, True, seed=32)
    x_linear = torch.randn(3, 96, generator=_gen(8)).to(torch.bfloat16)
    bias = torch.randn(48, generator=_gen(9)).to(torch.bfloat16)
    got = [fused_moe_experts_nf4(x, index, weights, gate_up, down, code, moe_combine, NF4MoEConfig(use_dot=use_dot, **TILES))
           for use_dot in (False, True)]
    got += [nf4_linear(x_linear, w.packed, w.absmax, code, 48, 96, bias,
                       config=NF4LinearConfig(use_dot=use_dot, block_n=32, block_k=64), **_linear_args(w))
            for use_dot in (False, True)]
    monkeypatch.setattr(torch.Tensor, "to", truncating_to)
    want = [fused_moe_experts_nf4_ref(x, index, weights, gate_up, down, code, config=NF4MoEConfig(use_dot=use_dot))
            for use_dot in (False, True)]
    want += [nf4_linear_ref(x_linear, w.packed, w.absmax, code, 48, 96, bias,
                            config=NF4LinearConfig(use_dot=use_dot), **_linear_args(w)) for use_dot in (False, True)]
    monkeypatch.undo()
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("nested", [False, True])
def test_layout_matches_bitsandbytes(nested):
    """bitsandbytes' own quantize_4bit output, read through NF4Tensors.from_bnb: the reference dequantizes like
    bitsandbytes' dequantize_4bit, and nf4_linear equals a matmul with it."""
    functional = pytest.importorskip("bitsandbytes.functional")
    weight = torch.randn(48, 128, generator=_gen(9))
    packed, state = functional.quantize_4bit(weight, blocksize=64, compress_statistics=nested, quant_type="nf4")
    assert torch.equal(functional.get_4bit_type("nf4", device="cpu"), torch.tensor(NF4_CODE))
    w = NF4Tensors.from_bnb(packed, state)
    assert w.nested == nested
    dense = functional.dequantize_4bit(packed, state)  # float32 [48, 128]
    assert torch.equal(dequantize_nf4_ref(w, nf4_code("cpu"), torch.float32), dense)
    x = torch.randn(2, 128, generator=_gen(10))
    w = NF4Tensors(*(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in w))
    got = nf4_linear(x.to(DEVICE), w.packed, w.absmax, nf4_code(DEVICE), 48, 128, **_linear_args(w))
    torch.testing.assert_close(got.cpu(), x @ dense.T, atol=1e-5, rtol=1e-5)


def test_wrong_inputs_raise_with_what_was_found():
    w = _random_nf4(None, 32, 128, nested=False, seed=11)
    x = torch.randn(1, 128).to(DEVICE)
    with pytest.raises(InvalidArgumentError, match="absmax must be torch.float32"):
        nf4_linear(x, w.packed, w.absmax.half(), nf4_code(DEVICE), 32, 128)
    with pytest.raises(InvalidArgumentError, match="x must be"):
        nf4_linear(x[:, :64], w.packed, w.absmax, nf4_code(DEVICE), 32, 128)
    with pytest.raises(InvalidArgumentError, match="nested NF4 needs"):
        nf4_linear(x, w.packed, w.absmax.to(torch.uint8), nf4_code(DEVICE), 32, 128, nested_code=torch.zeros(256))
    with pytest.raises(InvalidArgumentError, match="lookup=7 is not one of"):
        nf4_linear(x, w.packed, w.absmax, nf4_code(DEVICE), 32, 128, config=NF4LinearConfig(lookup=7))
    experts = _random_nf4(2, 64, 128, nested=False, seed=12)
    with pytest.raises(InvalidArgumentError, match="lookup=6 is not one of"):
        fused_moe_experts_nf4(x, torch.zeros(1, 1, dtype=torch.long, device=DEVICE), torch.ones(1, 1, device=DEVICE),
                              experts, _random_nf4(2, 128, 32, nested=False, seed=13), nf4_code(DEVICE), moe_combine,
                              NF4MoEConfig(lookup=6))


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("n, k", [(24, 512), (16, 96)])
def test_nf4_linear_wide_steps_sum_each_step(nested, n, k):
    """block_k >= 512 sums each step into a [BLOCK_N] accumulator (the batch-1 tiles); block_n 8 without tensor
    cores; K = 96 is one masked step, 64-blocks across rows."""
    w = _random_nf4(None, n, k, nested, seed=n + k)
    x = torch.randn(1, k, generator=_gen(3)).to(DEVICE, torch.bfloat16)
    code = nf4_code(DEVICE)
    config = NF4LinearConfig(use_dot=False, block_n=8, block_k=512, split_k=1)
    got = nf4_linear(x, w.packed, w.absmax, code, n, k, config=config, **_linear_args(w))
    want = nf4_linear_ref(x, w.packed, w.absmax, code, n, k, config=config, **_linear_args(w))
    assert _rel(got, want) < REL_TOL[torch.bfloat16]


def test_fused_moe_experts_nf4_wide_steps():
    experts, hidden, inter, top_k = 4, 64, 32, 2
    gate_up = _random_nf4(experts, 2 * inter, hidden, False, seed=31)
    down = _random_nf4(experts, hidden, inter, False, seed=32)
    x = torch.randn(2, hidden, generator=_gen(4)).to(DEVICE, torch.bfloat16)
    index = torch.tensor([[0, 2], [1, 2]], device=DEVICE)
    weights = torch.rand(2, top_k, generator=_gen(5)).to(DEVICE, torch.bfloat16)
    code = nf4_code(DEVICE)
    config = NF4MoEConfig(use_dot=False, gate_up_block_n=8, down_block_n=8, block_k=512)
    got = fused_moe_experts_nf4(x, index, weights, gate_up, down, code, moe_combine, config)
    want = fused_moe_experts_nf4_ref(x, index, weights, gate_up, down, code, config=config)
    assert _rel(got, want) < REL_TOL[torch.bfloat16]
