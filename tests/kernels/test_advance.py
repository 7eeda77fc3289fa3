"""The decode loop's bookkeeping kernel against the torch ops it replaces."""

import pytest
import torch

from moegraph.kernels import triton_available
from moegraph.kernels.advance import advance, advance_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not triton_available(torch.empty(0, device=DEVICE)), reason="Triton cannot run here")


def _state(rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return dict(
        next_tokens=torch.randint(0, 6, (rows,), generator=gen),  # small ids: EOS (2, 5) picked often
        tokens=torch.randint(0, 50, (rows, 12), generator=gen),
        unfinished=torch.rand(rows, generator=gen) > 0.3,
        alive=torch.ones(8, dtype=torch.bool),
        lengths=torch.randint(3, 9, (rows,), generator=gen),
        rope_start=torch.randint(3, 12, (rows,), generator=gen),
        next_inputs=tuple(torch.full((rows + 3,), -7) for _ in range(3)),
    )


def _run(fn, state, eos, last: bool):
    s = {k: (tuple(t.clone().to(DEVICE) for t in v) if isinstance(v, tuple) else v.clone().to(DEVICE))
         for k, v in state.items()}
    rows = s["next_tokens"].shape[0]
    next_inputs = None if last else tuple(t[:rows] for t in s["next_inputs"])
    fn(s["next_tokens"], s["tokens"], 7, s["unfinished"] if eos is not None else None,
       None if eos is None else eos.to(DEVICE), 0, s["alive"], 3, s["lengths"], s["rope_start"], next_inputs)
    return {k: (tuple(t.cpu() for t in v) if isinstance(v, tuple) else v.cpu()) for k, v in s.items()}


@pytest.mark.parametrize("rows", [1, 3, 8, 33])
@pytest.mark.parametrize("eos", [None, torch.tensor([2]), torch.tensor([2, 5, 9])])
@pytest.mark.parametrize("last", [False, True])
def test_advance_equals_the_torch_ops(rows, eos, last):
    state = _state(rows, seed=rows)
    got, want = _run(advance, state, eos, last), _run(advance_ref, state, eos, last)
    for key in want:
        for g, w in zip(*((got[key], want[key]) if isinstance(want[key], tuple) else ((got[key],), (want[key],)))):
            assert torch.equal(g, w), key
    if last:  # the static inputs are left alone on the last step
        assert all((t == -7).all() for t in got["next_inputs"])


def test_advance_refuses_bool_tensors_of_another_dtype():
    state = _state(2, seed=0)
    with pytest.raises(ValueError, match="unfinished / alive bool"):
        advance(state["next_tokens"], state["tokens"], 7, state["unfinished"].long(), torch.tensor([2]), 0,
                state["alive"], 3, state["lengths"], state["rope_start"], None)
