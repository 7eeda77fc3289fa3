"""What the decode benchmarks share: greedy decode ms/step of a patched model (graphs on), and an A/B table."""

import statistics

import torch

import moegraph
from moegraph.testing import random_prompts


def decode_arguments(parser, batch_sizes: str = "1,8"):
    """The flags every decode A/B script takes: layers, new tokens, batch sizes, runs, --no-nf4."""
    parser.add_argument("--num-layers", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default=batch_sizes)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-nf4", action="store_true")
    return parser


def decode(model, batch_size: int, new_tokens: int, runs: int):
    """(median decode ms/step, tokens on the CPU, the last call's decode_stats) of `runs` greedy calls after a warm
    one, on fixed prompts of 16-128 tokens."""
    inputs = random_prompts(batch_size, vocab_size=model.config.vocab_size, min_len=16, max_len=128,
                            seed=batch_size, device="cuda")
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    moegraph.patch(model, max_batch_size=max(batch_size, 8))
    try:
        tokens = model.generate(**inputs, **kw)
        times = []
        for _ in range(max(runs, 1)):
            model.generate(**inputs, **kw)
            stats = moegraph.decode_stats(model)
            times.append(1e3 * stats.decode_seconds / max(stats.steps - 1, 1))
    finally:
        moegraph.unpatch(model)
    return statistics.median(times), tokens.cpu(), stats


def replay_us(fn, calls=20, replays=10):
    """Microseconds of one fn() call: `calls` of them captured back to back in a CUDA graph (launch gaps count as
    in the decode graphs), replayed `replays` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (calls * replays)


def ab_table(rows, off: str, on: str) -> str:
    """rows of (weights, batch, ms off, ms on, same tokens) as a table; off/on: the columns' names."""
    lines = [f"{'weights':>7} {'bs':>3} {off + ' ms':>14} {on + ' ms':>14} {'speedup':>7} same tokens"]
    lines += [f"{w:>7} {bs:>3} {a:14.3f} {b:14.3f} {a / b:7.3f} {same}" for w, bs, a, b, same in rows]
    return "\n".join(lines)


def same_tokens(a: torch.Tensor, b: torch.Tensor) -> str:
    """'yes', or the share of equal tokens (kernels that sum in another order may flip a near-tie)."""
    return "yes" if torch.equal(a, b) else f"{(a == b).float().mean().item():.1%}"
