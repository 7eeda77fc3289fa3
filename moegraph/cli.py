"""`python -m moegraph demo|info|parity|accuracy|bench`."""

from __future__ import annotations

import argparse
import logging
import sys


def _info(args) -> int:
    if args.model is not None:
        return _fit(args)
    import platform

    import torch
    import transformers

    import moegraph
    from moegraph.ops import resolve_ops

    print(f"moegraph       {moegraph.__version__}")
    print(f"python         {platform.python_version()}")
    print(f"torch          {torch.__version__} (CUDA {torch.version.cuda})")
    print(f"transformers   {transformers.__version__}")
    for name in ("triton", "bitsandbytes"):
        try:
            module = __import__(name)
            print(f"{name:<14} {module.__version__}")
        except Exception as exc:  # an optional package may be missing or broken; say which
            print(f"{name:<14} unavailable ({type(exc).__name__})")
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        cc = torch.cuda.get_device_capability(device)
        print(f"device         {torch.cuda.get_device_name(device)} (compute capability {cc[0]}.{cc[1]})")
    else:
        device = torch.device("cpu")
        print("device         cpu (no CUDA GPU visible)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ops = resolve_ops(device, dtype)
    print(f"moe backend    {ops.moe_backend} for {dtype} ({'capture-safe' if ops.capture_safe else 'eager only'})")
    print(ops.describe())
    from moegraph.kernels._triton import pdl_status

    why_not = pdl_status(device)
    print("graph launches " + ("programmatic dependent launch (MOEGRAPH_PDL=0 turns it off)" if why_not is None
                               else f"plain: {why_not}"))
    return 0


def _fit(args) -> int:
    from .errors import MoegraphError
    from .fit import fit_report

    try:
        print(fit_report(args.model, batch_size=args.batch_size, seq_len=args.seq_len, device=args.device))
    except MoegraphError as exc:  # a config that cannot be read, an unknown GPU: the message says what to do
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _demo(args) -> int:
    import time

    import torch

    import moegraph
    from moegraph.testing import build_model, random_prompts

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model("tiny", device=device, dtype=dtype, seed=0)
    prompts = random_prompts(args.batch_size, vocab_size=model.config.get_text_config().vocab_size, seed=0, device=device)
    kwargs = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=model.config.pad_token_id)
    print(f"demo: tiny random Qwen3-MoE on {device} ({dtype}), batch {args.batch_size}, {args.new_tokens} new tokens")

    def timed_generate():
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(**prompts, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        return out, time.perf_counter() - start

    timed_generate()  # warm-up
    reference, hf_seconds = timed_generate()
    moegraph.patch(model, cuda_graphs=False)
    eager, _ = timed_generate()
    moegraph.unpatch(model)
    moegraph.patch(model)
    timed_generate()  # the first call allocates the static cache and captures the graphs
    patched, mg_seconds = timed_generate()
    stats = moegraph.decode_stats(model)
    moegraph.unpatch(model)
    tokens = args.batch_size * args.new_tokens
    mode = "CUDA graphs" if stats.graphs else "eager loop: no CUDA graphs on this device"
    agree = (patched == reference).float().mean().item()
    print(f"transformers generate : {tokens / hf_seconds:9.1f} tok/s")
    print(f"moegraph ({mode}): {tokens / mg_seconds:9.1f} tok/s, host {stats.host_ms_per_step:.3f} ms/step, "
          f"capture {stats.capture_seconds:.2f} s")
    print(f"tokens equal to unpatched transformers: {100 * agree:.1f}%"
          + ("" if dtype == torch.float32 else " (bf16: rounding can flip near-tied greedy picks)"))
    if stats.graphs:
        print(f"graph replay equal to moegraph's eager loop: {torch.equal(patched, eager)}")
    ok = torch.equal(patched, eager) and (dtype != torch.float32 or agree == 1.0)
    return 0 if ok else 1


def _parity(args) -> int:
    from .parity import run_parity

    return run_parity(args)


def _accuracy(args) -> int:
    from .accuracy import run_accuracy

    return run_accuracy(args)


def _bench(args) -> int:
    from .bench import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moegraph", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log moegraph's decisions (INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, device, the MoE backend chosen and why; with --model: will it fit?")
    info.add_argument("--model", default=None,
                      help="Hub name, local config.json (or its folder), or a moegraph.testing preset such as "
                           "qwen3-30b-a3b: weight sizes, KV cache, fit, dtype and backend (reads the config only)")
    info.add_argument("--batch-size", type=int, default=1, help="rows of the static KV cache (with --model)")
    info.add_argument("--seq-len", type=int, default=4096, help="prompt + new tokens per row (with --model)")
    info.add_argument("--device", default=None,
                      help="cpu, cuda:N, or a GPU name (T4, A100-40GB, A100-80GB, A10, RTX3090, L4, RTX4090, H100, "
                           "H200, B200); default: the GPU at hand, else the CPU")
    info.set_defaults(func=_info)

    demo = sub.add_parser("demo", help="tiny random model: patched vs unpatched tokens and speed")
    demo.add_argument("--batch-size", type=int, default=4)
    demo.add_argument("--new-tokens", type=int, default=32)
    demo.set_defaults(func=_demo)

    parity = sub.add_parser("parity", help="greedy tokens: graph vs eager vs pure transformers")
    parity.add_argument("--model", default=None, help="config name (default: qwen3-30b-a3b on GPU, tiny on CPU)")
    parity.add_argument("--num-layers", type=int, default=None)
    parity.add_argument("--new-tokens", type=int, default=32)
    parity.set_defaults(func=_parity)

    accuracy = sub.add_parser("accuracy", help="per-step logits and greedy argmax of bf16 / NF4 variants against "
                                                 "an fp32 copy of the same weights")
    accuracy.add_argument("--model", default=None, help="config name (default: qwen3-30b-a3b on GPU, tiny on CPU)")
    accuracy.add_argument("--num-layers", type=int, default=None, help="decoder layers (default: 12 on GPU)")
    accuracy.add_argument("--prompts", type=int, default=None, help="prompts in all (default: 8 on GPU, 4 on CPU)")
    accuracy.add_argument("--batch-size", type=int, default=None, help="prompts per generate (default: 8 / 2)")
    accuracy.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per prompt (default: 32 / 8)")
    accuracy.add_argument("--variants", default=None,
                          help="comma-separated subset of fp32,moegraph_bf16,hf_bf16,moegraph_nf4,hf_nf4,hf_4bit "
                               "(default: all)")
    accuracy.add_argument("--out", default=None, help="write the figures as JSON to this file")
    accuracy.set_defaults(func=_accuracy)

    bench = sub.add_parser("bench", help="decode benchmark against transformers, with the bandwidth roofline")
    bench.add_argument("--model", default="qwen3-30b-a3b",
                       help="preset of moegraph.testing (random weights), e.g. qwen3-30b-a3b, mixtral-8x7b")
    bench.add_argument("--num-layers", type=int, default=None, help="decoder layers (default: all of the preset)")
    bench.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    bench.add_argument("--batch-sizes", default=None,
                       help="default: 1,8,32,64 for the decode table, 1,8 for --prompt-len and --ttft, 1 for --profile")
    bench.add_argument("--backends", default=None,
                       help="default: hf,hf_batched_mm,hf_static_compile,moegraph_eager,moegraph for the decode "
                            "table, hf,moegraph for --prompt-len, --long and --ttft; when named, moegraph with its prefill "
                            "forced: moegraph_prefill (prefill='graphs'), moegraph_hf_prefill "
                            "(prefill='transformers')")
    bench.add_argument("--new-tokens", type=int, default=64)
    bench.add_argument("--runs", type=int, default=3, help="timed runs per case (median reported)")
    bench.add_argument("--budget-s", type=float, default=45.0,
                       help="time budget per backend and batch size; over it a case is reported, not run")
    bench.add_argument("--total-budget-s", type=float, default=540.0,
                       help="wall-clock budget of the whole run; cases that no longer fit are reported as over budget")
    bench.add_argument("--quant", choices=["none", "nf4"], default="none",
                       help="nf4: after the cases above, the same model with Linear4bit projections (hf_4bit) and "
                            "then NF4 experts too (moegraph_nf4)")
    bench.add_argument("--double-quant", action="store_true",
                       help="with --quant nf4: double-quantized absmax (bnb_4bit_use_double_quant)")
    bench.add_argument("--sample", action="store_true",
                       help="decode table: each case also sampled (do_sample, temperature 0.7, top_p 0.9, top_k 50) "
                            "beside greedy, with moegraph's host ms/step")
    bench.add_argument("--prompt-len", default=None, metavar="LENS",
                       help="instead of the decode table: decode ms/step and tok/s at prompts of exactly these "
                            "lengths, e.g. 512,4096,16384,32768")
    bench.add_argument("--long", nargs="?", const="32,256,1024", default=None, metavar="B,P,N",
                       help="instead of the decode table: B rows of P-token prompts, N sampled tokens "
                            "(default 32,256,1024)")
    bench.add_argument("--ttft", nargs="?", const="16,512,4096", default=None, metavar="LENS",
                       help="instead of the decode table: time to first token at these prompt lengths "
                            "(default 16,512,4096)")
    bench.add_argument("--profile", choices=["decode", "prefill", "all"], default=None,
                       help="instead of the decode table: kernels per layer and top kernels of one decode step "
                            "(and its graph replay time) and/or of one first token")
    bench.add_argument("--profile-prompt-len", type=int, default=128, help="prompt tokens of --profile prefill")
    bench.add_argument("--out", default="results", help="folder for the JSON (and the decode table's PNG plot)")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s",
                        stream=sys.stderr)
    return args.func(args)
