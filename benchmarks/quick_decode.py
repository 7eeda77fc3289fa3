"""Quick GPU look, for iteration: decode tok/s of transformers vs moegraph (eager loop / graphs) on a
few full-size layers, and the kernels one decode step (`--profile prefill|all`: one first token) launches per layer,
from moegraph.profile_model, as the bench's --profile.
Final figures come from `python -m moegraph bench`."""

import argparse
import torch

import moegraph
from moegraph.bench import timed_call as timed
from moegraph.testing import build_model, random_prompts


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--profile", choices=["decode", "prefill", "all"], default="decode")
    args = parser.parse_args()
    model = build_model("qwen3-30b-a3b", num_layers=args.num_layers, device="cuda", dtype=torch.bfloat16)
    for profile in moegraph.profile_model(model, args.profile, batch_size=1, prompt_len=128).values():
        print(profile.format(top=30))
    rows = []
    for bs in map(int, args.batch_sizes.split(",")):
        inputs = random_prompts(bs, vocab_size=model.config.vocab_size, min_len=16, max_len=128, device="cuda")
        kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
        model.generate(**inputs, max_new_tokens=4)
        ref, t_hf = timed(lambda: model.generate(**inputs, **kw))
        rows.append((bs, "hf", bs * args.new_tokens / t_hf, float("nan"), float("nan"), 0.0, 1.0))
        for graphs in (False, True):
            moegraph.patch(model, cuda_graphs=graphs, max_batch_size=max(bs, 8))
            model.generate(**inputs, **kw)
            out, t = timed(lambda: model.generate(**inputs, **kw))
            st = moegraph.decode_stats(model)
            same = (out == ref).float().mean().item()
            rows.append((bs, "graphs" if graphs else "eager", bs * args.new_tokens / t,
                         1e3 * st.decode_seconds / st.steps, st.host_ms_per_step, st.capture_seconds, same))
            moegraph.unpatch(model)
    print(f"layers={args.num_layers} new_tokens={args.new_tokens}")
    print(f"{'bs':>4} {'path':>7} {'tok/s':>9} {'ms/step':>8} {'host ms':>8} {'capture s':>9} {'eq hf':>6}")
    for r in rows:
        print(f"{r[0]:>4} {r[1]:>7} {r[2]:9.1f} {r[3]:8.2f} {r[4]:8.3f} {r[5]:9.2f} {r[6]:6.2f}")


if __name__ == "__main__":
    main()
