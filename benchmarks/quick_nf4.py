"""Quick GPU look, for iteration: moegraph decode ms/step with bf16 experts against NF4 experts (and
Linear4bit projections) on a few full-size Qwen3-30B-A3B layers, the same model quantized in place,
plus the kernels of one NF4 decode step. Final figures come from `python -m moegraph bench --quant nf4`."""

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import moegraph
from moegraph.bench import timed_call
from moegraph.quant.experts import quantize_experts
from moegraph.quant.projections import quantize_projections
from moegraph.testing import build_model, random_prompts


def decode_ms(model, batch_size, new_tokens):
    inputs = random_prompts(batch_size, vocab_size=model.config.vocab_size, min_len=16, max_len=128,
                            seed=batch_size, device="cuda")
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    moegraph.patch(model, max_batch_size=max(batch_size, 8))
    try:
        model.generate(**inputs, **kw)
        out, seconds = timed_call(lambda: model.generate(**inputs, **kw))
        stats = moegraph.decode_stats(model)
        replay_ms(model, batch_size)
    finally:
        moegraph.unpatch(model)
    return 1e3 * stats.decode_seconds / max(stats.steps - 1, 1), 1e3 * stats.prefill_seconds, stats.graphs


def replay_ms(model, batch_size, replays=50):
    """GPU time of the bucket's graph alone, back to back: what the step costs without the host's share."""
    graphs = model._moegraph_state.decoder.graphs
    rows = min(b for b in graphs.graphs if b >= batch_size)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graphs.replay(rows)
    start.record()
    for _ in range(replays):
        graphs.replay(rows)
    end.record()
    torch.cuda.synchronize()
    print(f"graph replay bs {batch_size} (bucket {rows}): {start.elapsed_time(end) / replays:.3f} ms")


def kernels_of_one_step(model, label, batch_size=1, top=14):
    moegraph.patch(model, max_batch_size=8)
    inputs = random_prompts(batch_size, vocab_size=model.config.vocab_size, device="cuda")
    model.generate(**inputs, max_new_tokens=4)
    decoder = model._moegraph_state.decoder
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decoder._forward(batch_size)
        torch.cuda.synchronize()
    moegraph.unpatch(model)
    by_name = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            by_name[e.name][0] += 1
            by_name[e.name][1] += e.device_time
    total = sum(t for _, t in by_name.values())
    count = sum(c for c, _ in by_name.values())
    layers = model.config.num_hidden_layers
    print(f"{label} eager step bs {batch_size}: {count} kernels, {count / layers:.1f} per layer, "
          f"{total / 1e3:.2f} ms kernel time ({total / layers:.1f} us per layer)")
    for name, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {100 * t / total:5.1f}% {c:4d}x {t / c:7.2f} us {name[:80]}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch-sizes", default="1,8")
    args = parser.parse_args()
    model = build_model("qwen3-30b-a3b", num_layers=args.num_layers, device="cuda", dtype=torch.bfloat16)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = [("bf16", bs, *decode_ms(model, bs, args.new_tokens)) for bs in sizes]
    for bs in sizes:
        kernels_of_one_step(model, "bf16", bs)
    dense_gb = torch.cuda.memory_allocated() / 1e9
    quantize_projections(model)
    quantize_experts(model)
    torch.cuda.empty_cache()
    nf4_gb = torch.cuda.memory_allocated() / 1e9
    rows += [("nf4", bs, *decode_ms(model, bs, args.new_tokens)) for bs in sizes]
    for bs in sizes:
        kernels_of_one_step(model, "NF4", bs)
    print(f"layers={args.num_layers}: memory bf16 {dense_gb:.2f} GB -> NF4 {nf4_gb:.2f} GB")
    print(f"{'weights':>7} {'bs':>3} {'ms/step':>8} {'prefill ms':>10} graphs")
    for name, bs, ms, prefill, graphs in rows:
        print(f"{name:>7} {bs:>3} {ms:8.3f} {prefill:10.1f} {graphs}")


if __name__ == "__main__":
    main()
