"""The sections of `python -m moegraph bench` beyond its regular decode table (moegraph/bench.py), each one function of
the bench's Session that fills its rows into the JSON result and returns its markdown table:

- `--prompt-len 512,4096,...`: decode ms/step and tok/s at each prompt length (every row exactly that long) and batch
  size, the roofline of each row with the KV cache its context reads; a backend over its budget at one length is
  not run at the longer ones (said in the table);
- `--long [B,P,N]`: B rows of P-token prompts, N sampled tokens (bench.SAMPLING): tok/s of a long sampled run;
- `--ttft [16,512,4096]`: time to first token, generate(max_new_tokens=1) synchronized, median of --runs;
- `--profile decode|prefill|all`: moegraph.profile_model at each batch size (kernels per layer, top kernels, GPU
  replay time; one first token of --profile-prompt-len tokens).
"""

from __future__ import annotations

from dataclasses import asdict

import moegraph

from .bench import Case, Session, TtftCase, decode_table, markdown, num, print_progress, status


def _ints(text: str) -> list:
    return [int(v) for v in text.split(",")]


def prompt_len_mode(session: Session) -> str:
    args = session.args
    cases, skipped_from = [], {}  # (backend, batch) -> the length at which it went over budget
    for backend in session.backends("hf,moegraph"):
        for prompt_len in _ints(args.prompt_len):
            for batch_size in session.batch_sizes("1,8"):
                case = _context_case(session, backend, batch_size, prompt_len, skipped_from.get((backend, batch_size)))
                if case.status.startswith("over budget"):
                    skipped_from.setdefault((backend, batch_size), prompt_len)
                cases.append(case)
    cases.sort(key=lambda c: (c.prompt_len, c.batch_size, c.backend))
    session.results["prompt_len_cases"] = [asdict(c) for c in cases]
    return "decode by prompt length (greedy)\n\n" + decode_table(cases, prompt=True, host=False)


def _context_case(session: Session, backend: str, batch_size: int, prompt_len: int, over_at: int | None):
    if over_at is not None:  # longer contexts only take longer
        case = Case(backend, batch_size, prompt_len, session.args.new_tokens)
        case.status = f"over budget: skipped (over budget at {over_at}-token prompts)"
    else:
        case = session.runner.run(backend, batch_size, session.prompts(batch_size, prompt_len), prompt_len=prompt_len)
    session.add_roofline(case, prompt_len + case.new_tokens / 2)
    print_progress(case)
    return case


def long_mode(session: Session) -> str:
    batch_size, prompt_len, new_tokens = _ints(session.args.long)
    prompts = session.prompts(batch_size, prompt_len)
    cases = []
    for backend in session.backends("hf,moegraph"):
        case = session.runner.run(backend, batch_size, prompts, new_tokens=new_tokens, sample=True,
                                  prompt_len=prompt_len)
        session.add_roofline(case, prompt_len + case.new_tokens / 2)
        print_progress(case)
        cases.append(case)
    session.results["long_cases"] = [asdict(c) for c in cases]
    return (f"long sampled run: batch {batch_size}, {prompt_len}-token prompts, {new_tokens} new tokens\n\n"
            + decode_table(cases, prompt=True, host=True))


def ttft_mode(session: Session) -> str:
    cases = []
    for backend in session.backends("hf,moegraph"):
        for prompt_len in _ints(session.args.ttft):
            for batch_size in session.batch_sizes("1,8"):
                case = session.runner.ttft(backend, batch_size, session.prompts(batch_size, prompt_len))
                print_progress(case)
                cases.append(case)
    cases.sort(key=lambda c: (c.prompt_len, c.batch_size, c.backend))
    session.results["ttft_cases"] = [asdict(c) for c in cases]
    return "time to first token (prefill + first token)\n\n" + _ttft_table(cases)


def _ttft_table(cases: list[TtftCase]) -> str:
    hf = {(c.batch_size, c.prompt_len): c.ttft_ms for c in cases if c.backend == "hf" and c.status == "ok"}

    def vs_hf(c):
        base = hf.get((c.batch_size, c.prompt_len))
        return "-" if base is None or c.status != "ok" else f"{base / c.ttft_ms:.2f}"

    return markdown([("backend", lambda c: c.backend), ("bs", num("batch_size", "d")),
                     ("prompt", num("prompt_len", "d")), ("TTFT ms", num("ttft_ms", ".2f")),
                     ("min ms", num("min_ms", ".2f")), ("of it prefill ms", num("prefill_ms", ".2f")),
                     ("vs hf", vs_hf), ("runs", num("runs", "d")), ("1st call s", num("first_call_s")),
                     ("prefill", lambda c: c.prefill or "-"), ("status", status)], cases)


def profile_mode(session: Session) -> str:
    args, texts, stored = session.args, [], {}
    for batch_size in session.batch_sizes("1"):
        for kind, profile in moegraph.profile_model(session.model, args.profile, batch_size,
                                                    args.profile_prompt_len).items():
            texts.append(profile.format())
            stored[f"{kind}_bs{batch_size}"] = dict(
                {k: v for k, v in asdict(profile).items() if k != "kernels"}, format=profile.format(top=30),
                calls=profile.calls, total_us=profile.total_us, kernels=[asdict(k) for k in profile.kernels[:40]])
    session.results["profile"] = stored
    return "profiles\n\n```\n" + "\n\n".join(texts) + "\n```"
