#!/usr/bin/env bash
# The GPU checks a session owes what was written since the last one, in stages that each fit one device call
# (10 minutes; a session has 30 of device time). Logs and JSON go to $OUT (the device tool brings them back).
#
#   source .device-carry/activate.sh; bash tools/gpu_checks.sh STAGE...   (";": activate.sh fails where the carried
#   transformers does not import, and tools/device_env.sh then takes the machine's own; source it too before a
#   GPU command run by hand)
#
#   kernel_tests  ~5 min  kernels on CUDA, graph == eager (bf16, NF4), prefill graphs
#   model_tests   ~4 min  every family's graph == eager, robustness          (tests = both)
#   bench_decode  ~5 min  decode 1/8/32/64 beside transformers, first token   (bench = both)
#   bench_quant   ~4 min  NF4 against bf16, long generation
#   ab            ~9 min  the untimed switches, decode A/B
#   kernels       ~9 min  kernel timings (NF4 tiles, grouping, fused norms)
#   short         ~7.5 min  with little device time: a sample of each of the above but ab
#   nf4_shuffle   ~7 min  the warp-shuffle NF4 lookups (4, 5): their values, decode and kernel timings, graph == eager
#   batch1        ~10 min the NF4 GPU tests, then issue 8's batch-1 leads: the words lookup's tiles (kernels), the norms
#                           inside the GEMVs (q/k/v now on the words lookup behind its norm), the router's norm alone,
#                           short attention chunks (decode step, 48 layers), the kernels of one NF4 graph replay
#   wide_steps    ~8 min  issue 8: the one-row NF4 GEMVs' 16 x 2048 tiles (q/k/v): decode-step A/B, kernel checks,
#                           then nf4_final
#   shared_x      ~9 min  issue 8: two words a thread against one x load in the NF4 words loops, timed and checked
#   tiles8        ~8 min  issue 8: the new NF4 expert tiles in the decode step, graph == eager, the NF4 bench
#   steps1        ~4 min  issue 8: the one-token NF4 experts in wider steps: kernel times, decode-step A/B
#   dot_stages    ~6 min  NF4 at 32 / 64 rows with fewer pipelining stages: kernel times, decode-step A/B
#   done8         ~8 min  issue 8's "Done when": graph == eager, the NF4 bench at 1 / 8 / 32 / 64 beside bf16, memory
#   nf4_final     ~5 min  issue 8 with little device time: graph == eager with the day's defaults, the NF4 bench at
#                           batch 1 / 8
#   done11        ~9 min  issue 11's "Done when" figures: decode 1/8/32/64 greedy and sampled beside
#                           transformers, first token 16-4096 at batch 1 / 8, graph == eager, robustness
#
# Stages named together run in one call (keep a call under its 10 minutes): with little device time,
# `kernel_tests bench_decode` first. A stage goes on after a failing step (each step's exit status is printed) and
# bounds each step with timeout, so one slow step cannot cost the others their output.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_checks}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
source tools/device_env.sh  # the machine's own transformers where the carried one does not import

step() {  # step SECONDS NAME COMMAND...: run with a time limit, log to $out/NAME.txt, report the exit status
    local seconds=$1 name=$2
    shift 2
    local start=$SECONDS
    timeout --signal=INT "$seconds" "$@" 2>&1 | tee "$out/$name.txt"
    echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
}

stage() {
    case "$1" in
    kernel_tests)  # kernels on CUDA, graph == eager bit for bit (bf16, NF4), prefill graphs
        step 280 gpu_tests_kernels python3 -m pytest -q -p no:cacheprovider -rf tests/kernels tests/test_generate_cuda.py \
            tests/test_nf4_cuda.py
        ;;
    model_tests)  # every family's graph == eager, robustness
        step 260 gpu_tests_models python3 -m pytest -q -p no:cacheprovider -rf tests/models/test_families_cuda.py \
            tests/test_robustness_cuda.py
        ;;
    tests) stage kernel_tests; stage model_tests ;;
    kernels)  # kernel-level timings behind the defaults that wait on one: NF4 tiles / lookup / x pairs, grouping
        step 240 nf4_kernels python3 benchmarks/nf4_kernels.py
        step 200 align_blocks python3 benchmarks/align_blocks.py --num-layers 48 --runs 2
        step 120 fused_norms python3 benchmarks/fused_norms.py --num-layers 48 --batch-sizes 1 --runs 2 --no-nf4
        ;;
    ab)  # decode ms/step of each switch that waits on a timing, off and on, bf16 and NF4 (benchmarks/ab_decode.py)
        step 570 ab_decode python3 benchmarks/ab_decode.py --num-layers 48 --batch-sizes 1,8 --runs 2
        ;;
    bench_decode)  # issue 11: decode beside transformers, first token with and without prefill graphs
        step 150 bench_bf16 python3 -m moegraph bench --backends hf,moegraph --batch-sizes 1,8,32,64 --runs 3 \
            --total-budget-s 140 --out "$out"
        step 110 bench_ttft python3 -m moegraph bench --ttft 16,128,512 --backends hf,moegraph,moegraph_hf_prefill \
            --batch-sizes 1,8 --runs 3 --total-budget-s 95 --out "$out"
        ;;
    bench_quant)  # issue 8 (NF4 against bf16), long generation
        step 170 bench_nf4 python3 -m moegraph bench --quant nf4 --backends moegraph --batch-sizes 1,8 --runs 2 \
            --total-budget-s 150 --out "$out"
        step 90 bench_long python3 -m moegraph bench --long 32,256,1024 --backends moegraph --runs 1 \
            --total-budget-s 80 --out "$out"
        ;;
    bench) stage bench_decode; stage bench_quant ;;
    short)  # the least a session owes with little device time (~7.5 min): graph == eager (bf16, NF4, prefill
            # graphs), decode and first token at batch 1 / 8, the NF4 expert kernels' tiles
        step 150 gpu_tests_short python3 -m pytest -q -p no:cacheprovider -rf tests/test_generate_cuda.py \
            tests/test_nf4_cuda.py
        step 100 bench_bf16 python3 -m moegraph bench --backends hf,moegraph --batch-sizes 1,8 --runs 2 \
            --total-budget-s 90 --out "$out"
        step 80 bench_ttft python3 -m moegraph bench --ttft 16,128 --backends hf,moegraph,moegraph_hf_prefill \
            --batch-sizes 1 --runs 3 --total-budget-s 65 --out "$out"
        step 120 nf4_kernels python3 benchmarks/nf4_kernels.py --only moe
        ;;
    done11)  # issue 11's "Done when" in one call: one decode table (greedy and sampled rows) beside transformers,
             # the first token, graph == eager and the robustness tests (capture counts, soak)
        step 240 bench_sample python3 -m moegraph bench --sample --backends hf,moegraph --batch-sizes 1,8,32,64 \
            --runs 3 --total-budget-s 225 --out "$out"
        step 100 bench_ttft python3 -m moegraph bench --ttft 16,128,4096 --backends hf,moegraph \
            --batch-sizes 1,8 --runs 3 --total-budget-s 90 --out "$out"
        step 200 gpu_tests_done11 python3 -m pytest -q -p no:cacheprovider -rf tests/test_generate_cuda.py \
            tests/test_nf4_cuda.py tests/test_robustness_cuda.py
        ;;
    nf4_shuffle)  # issue 8: the warp-shuffle code lookups (LOOKUP 4, 5): their values, the decode step, kernel times
        step 60 gpu_tests_shuffle python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_nf4_kernels.py \
            -k "lookup or shuffle or pairs"
        step 120 ab_shuffle bash -c "cd benchmarks && python3 ab_decode.py --num-layers 48 --switches nf4_shuffle \
            --batch-sizes 1,8 --runs 2"
        step 100 gpu_tests_nf4_shuffle python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import ab_decode, pytest
ab_decode._nf4_shuffle(True)  # the NF4 graph == eager tests with every NF4 loop on the shuffle lookup
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-rf', 'tests/test_nf4_cuda.py']))"
        step 150 nf4_kernels_shuffle python3 benchmarks/nf4_kernels.py \
            --configs "fma lookup4,fma lookup4 pairs,fma lookup3 pairs,fma lookup5,auto lookup4,auto lookup5"
        ;;
    batch1)  # issue 8: what might take the NF4 batch-1 step from 2.51 ms towards 2.16 (1.5x bf16's 3.24, H100)
        step 120 gpu_tests_nf4 python3 -m pytest -q -p no:cacheprovider -rf tests/test_nf4_cuda.py \
            tests/kernels/test_nf4_kernels.py -k "nf4_cuda or float32 or add_rms_norm_in_front or words or captured"
        step 170 nf4_kernels_words python3 benchmarks/nf4_kernels.py --configs "auto,auto lookup1,fma lookup1,w5 \
bn8 bk1024 w4,w5 bn16 bk2048 w4,w5 bn4 bk2048 w2,w5 bn8 bk512 w4,w5 bn16 bk512 w2,w5 bn32 bk1024 w8,w5 8/16 bk256 w4,\
w5 8/16 bk512 w4,w5 16/32 bk512 w4,w5 4/8 bk512 w2,w5 16/32 bk256 w8,w5 32/64 bk256 w8,w5 16/32 bk1024 w4,w5 8/8 bk1024 w2"
        step 180 ab_batch1 bash -c "cd benchmarks && python3 ab_decode.py --num-layers 48 --switches \
            fuse_norms,fuse_router_norm,attn_short_chunks --batch-sizes 1,8 --runs 2"
        step 90 quick_nf4_graph bash -c "cd benchmarks && python3 quick_nf4.py --num-layers 8 --batch-sizes 1"
        ;;
    defaults_tests)  # graph == eager (bf16, NF4) and decode attention with the defaults of 2026-12-07
        step 200 gpu_tests_defaults python3 -m pytest -q -p no:cacheprovider -rf tests/test_nf4_cuda.py \
            tests/test_generate_cuda.py tests/kernels/test_decode_attention.py
        ;;
    wide_steps)  # issue 8: one-row NF4 GEMVs of >= 4096 outputs in 16 x 2048 tiles (nf4_gemv.WIDE_TILE, the default
                 # since its kernel timing): the decode-step A/B, the PDL and kernel checks, then nf4_final
        step 170 ab_wide_steps bash -c "cd benchmarks && python3 ab_decode.py --num-layers 48 --switches \
            nf4_wide_steps --batch-sizes 1,8 --runs 2"
        step 200 gpu_tests_kernels python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_pdl.py \
            tests/kernels/test_kernels.py tests/kernels/test_nf4_kernels.py  # 120 s ran out while Triton compiled
        stage nf4_final
        ;;
    shared_x)  # issue 8: each thread of the NF4 words loops decodes two words against one x load (SHARED_X, the
               # same bits): the bit checks on CUDA, kernel times, the decode-step A/B, graph == eager
        step 120 gpu_tests_shared_x python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_pdl.py \
            tests/kernels/test_nf4_kernels.py -k "pdl or sharing_x or words"
        step 150 nf4_kernels_shared_x python3 benchmarks/nf4_kernels.py --rows 1,8 --configs "auto shared,w5 8/16 \
bk256 w8,w5 8/16 bk256 w8 alone,w5 8/16 gu512 dn256 w8,w5 8/16 gu512 dn256 w4,w5 8/32 bk256 w8,w5 16/32 bk256 w8,\
w5 16/32 bk256 w8 alone"
        step 170 ab_shared_x bash -c "cd benchmarks && python3 ab_decode.py --num-layers 48 --switches nf4_shared_x \
            --batch-sizes 1,8 --runs 2"
        step 120 gpu_tests_nf4 python3 -m pytest -q -p no:cacheprovider -rf tests/test_nf4_cuda.py
        ;;
    tiles8)  # issue 8 after the shared_x timings, most wanted first: the NF4 bench at batch 1 / 8 beside bf16 with
             # the new defaults, graph == eager, then the three new NF4 expert choices in the decode step (A/B)
        step 150 bench_nf4 python3 -m moegraph bench --quant nf4 --backends moegraph --batch-sizes 1,8 --runs 2 \
            --total-budget-s 130 --out "$out"
        step 120 gpu_tests_tiles8 python3 -m pytest -q -p no:cacheprovider -rf tests/test_nf4_cuda.py \
            tests/kernels/test_nf4_kernels.py -k "nf4_cuda or sharing or few"
        step 200 ab_tiles8 bash -c "cd benchmarks && python3 ab_decode.py --num-layers 48 --switches \
            nf4_shared_x,nf4_one_token_k512,nf4_few_16_32 --batch-sizes 1,8 --runs 2"
        ;;
    tiles8_short)  # tiles8 in ~5.5 minutes: the bench, graph == eager, one A/B row at batch 1
        step 150 bench_nf4 python3 -m moegraph bench --quant nf4 --backends moegraph --batch-sizes 1,8 --runs 2 \
            --total-budget-s 130 --out "$out"
        step 90 gpu_tests_tiles8 python3 -m pytest -q -p no:cacheprovider -rf tests/test_nf4_cuda.py
        step 90 ab_tiles8 bash -c "cd benchmarks && python3 ab_decode.py --num-layers 48 --switches \
            nf4_one_token_k512 --batch-sizes 1 --runs 2"
        ;;
    done8)  # issue 8's "Done when" in one call (on an H200 where one is lent): graph == eager with the defaults,
            # the NF4 bench beside bf16 at batch 1 / 8 / 32 / 64, memory after loading and peak
        stage defaults_tests
        step 240 bench_nf4_done8 python3 -m moegraph bench --quant nf4 --backends moegraph --batch-sizes 1,8,32,64 \
            --runs 2 --total-budget-s 220 --out "$out"
        ;;
    steps1)  # issue 8: the one-token NF4 experts in fewer, wider steps: the decode step A/B, then kernel times
        step 110 ab_steps1 bash -c "cd benchmarks && python3 ab_decode.py --num-layers 48 --switches \
            nf4_one_token_gu1024,nf4_one_token_gu2048 --batch-sizes 1 --runs 2"
        step 120 nf4_kernels_steps1 python3 benchmarks/nf4_kernels.py --only moe --rows 1 --configs \
            "w5 8/16 gu1024 dn256 w8,w5 8/16 gu2048 dn256 w8,w5 16/32 gu512 dn256 w8"
        ;;
    dot_stages)  # the NF4 tensor-core path (16+ tokens) with fewer pipelining stages: kernel times, decode A/B
        step 150 nf4_kernels_dot python3 benchmarks/nf4_kernels.py --only moe --rows 32,64 --configs "dot s2,dot s1"
        step 200 ab_dot_stages bash -c "cd benchmarks && python3 ab_decode.py --num-layers 48 --switches \
            nf4_dot_stages2,nf4_dot_stages1 --batch-sizes 32,64 --runs 2"
        ;;
    nf4_final)  # issue 8 with little device time: graph == eager with the day's defaults, the NF4 bench
        stage defaults_tests
        step 150 bench_nf4 python3 -m moegraph bench --quant nf4 --backends moegraph --batch-sizes 1,8 --runs 2 \
            --total-budget-s 130 --out "$out"
        ;;
    *)
        echo "usage: $0 STAGE... (kernel_tests model_tests tests kernels ab bench_decode bench_quant bench short done11 nf4_shuffle batch1 defaults_tests wide_steps shared_x tiles8 tiles8_short done8 steps1 dot_stages nf4_final)" >&2
        exit 2
        ;;
    esac
}

[ $# -gt 0 ] || stage usage
for name in "$@"; do stage "$name"; done
