"""`python -m moegraph accuracy` on the CPU: a tiny model, a few tokens; its figures must be sane, and able to fail."""

import json

import pytest
import torch

import moegraph
from moegraph import accuracy
from moegraph.cli import main

VARIANTS = "fp32,moegraph_bf16,hf_bf16,moegraph_nf4"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    pytest.importorskip("bitsandbytes")
    out = tmp_path_factory.mktemp("accuracy") / "accuracy.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model gains nothing from intra-op threads, and a busy CI machine loses much
    try:
        rc = main(["accuracy", "--num-layers", "2", "--prompts", "3", "--batch-size", "2", "--new-tokens", "3",
                   "--variants", VARIANTS, "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    return {r["variant"]: r for r in json.loads(out.read_text())["results"]}


def test_every_variant_ran_on_every_token(report):
    assert list(report) == VARIANTS.split(",")
    assert all(r["status"] == "ok" and r["tokens"] == 3 * 3 for r in report.values())  # 3 prompts x 3 steps
    assert any("eager loop" in note for note in report["moegraph_bf16"]["notes"])


def test_fp32_against_its_own_teacher_forcing_is_the_floor(report):
    # a cached decode over left-padded rows (batch of 2 prompts of different lengths) vs one full forward:
    # wrong position ids or a shifted step would give errors of order 1 here
    assert report["fp32"]["rel_l2_max"] < 1e-5
    assert report["fp32"]["argmax_agreement"] == 1.0


def test_bf16_and_nf4_errors_are_of_their_precision(report):
    floor = report["fp32"]["rel_l2_mean"]
    for name in ("moegraph_bf16", "hf_bf16"):  # bf16 casts of the same weights: ~1e-2, not ~1 (other weights)
        assert 100 * floor < report[name]["rel_l2_mean"] < 0.1
    nf4 = report["moegraph_nf4"]["rel_l2_mean"]
    assert report["moegraph_bf16"]["rel_l2_mean"] < nf4 < 1.0
    assert any("projections" in n for n in report["moegraph_nf4"]["notes"]) or nf4 > 0


def test_compare_measures_relative_error_and_argmax():
    ref = torch.tensor([[[3.0, 4.0, 0.0], [0.0, 1.0, 2.0]]])  # [B=1, N=2, V=3]
    got = ref.clone()
    got[0, 0] *= 1.01
    got[0, 1] = torch.tensor([2.0, 1.0, 0.0])
    rel, same = accuracy.compare(got, ref)
    assert torch.allclose(rel, torch.tensor([[0.01, (8 ** 0.5) / (5 ** 0.5)]]))
    assert same.tolist() == [[True, False]]


def test_unknown_variant_is_refused_with_the_choices():
    with pytest.raises(moegraph.InvalidArgumentError, match="moegraph_nf4"):
        accuracy.parse_variants("bf17")
