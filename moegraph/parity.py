"""`python -m moegraph parity`: greedy tokens of graph replay vs moegraph's eager loop vs pure transformers.

Real Qwen3 weights cannot be downloaded here: the model is the random-weight Qwen3-30B-A3B
shape from moegraph.testing (tiny on a CPU) and the prompts are fixed token ids.
"""

from __future__ import annotations

import torch

import moegraph
from moegraph.testing import build_model, random_prompts

PROMPT_LENGTHS = (24, 57, 113)


def _prompts(vocab_size: int, device) -> list[dict]:
    out = []
    for i, length in enumerate(PROMPT_LENGTHS):
        out.append(random_prompts(1, vocab_size=vocab_size, min_len=length, max_len=length, seed=100 + i,
                                  device=device))
    return out


def _greedy(model, prompt, new_tokens):
    return model.generate(**prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          return_dict_in_generate=True, output_logits=True)


def _compare(a, b, reference_logits, prompt_len):
    """(matching new tokens, first divergence or None, reference's top-2 logit margin there)."""
    new_a, new_b = a[0, prompt_len:], b[0, prompt_len:]
    diff = (new_a != new_b).nonzero()
    if diff.numel() == 0:
        return int(new_a.numel()), None, None
    pos = int(diff[0, 0])
    top2 = reference_logits[pos][0].float().topk(2).values
    return int((new_a == new_b).sum()), pos, float(top2[0] - top2[1])


def run_parity(args) -> int:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    name = args.model or ("qwen3-30b-a3b" if cuda else "tiny")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model(name, device=device, dtype=dtype, num_layers=args.num_layers, seed=0)
    n = args.new_tokens
    print(f"parity: random-weight {name} ({model.config.get_text_config().num_hidden_layers} layers, {dtype}) on {device}; "
          f"fixed token-id prompts of {PROMPT_LENGTHS} tokens, {n} greedy tokens each (no real weights offline)")
    results = []
    for prompt in _prompts(model.config.get_text_config().vocab_size, device):
        hf = _greedy(model, prompt, n)
        moegraph.patch(model, cuda_graphs=False)
        eager = _greedy(model, prompt, n)
        moegraph.unpatch(model)
        moegraph.patch(model)
        graph = _greedy(model, prompt, n)
        used_graphs = moegraph.decode_stats(model).graphs
        moegraph.unpatch(model)
        plen = prompt["input_ids"].shape[1]
        results.append((plen, _compare(graph.sequences, eager.sequences, eager.logits, plen),
                        _compare(graph.sequences, hf.sequences, hf.logits, plen), used_graphs))
    print(f"{'prompt':>6} {'graph=eager':>11} {'graph=hf':>8}  first divergence from hf (top-2 margin there)")
    ok = True
    for plen, (ge, _, _), (gh, pos, margin), used_graphs in results:
        where = "none" if pos is None else f"new token {pos} (margin {margin:.4f})"
        print(f"{plen:>6} {ge:>8}/{n} {gh:>5}/{n}  {where}")
        ok &= ge == n
    print("graph replay: " + ("yes" if results[0][3] else "no (eager loop only on this device)"))
    return 0 if ok else 1
