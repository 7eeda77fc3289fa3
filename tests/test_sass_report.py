"""tools/sass_report.py: the NF4 decode kernels compiled for sm_90 on this machine (Triton's own ptxas), read back.

The tool needs Triton's compiler, not its interpreter (which this suite turns on): it runs in a subprocess."""

import os
import pathlib
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
TOOL = pathlib.Path(__file__).resolve().parents[1] / "tools" / "sass_report.py"
pytestmark = pytest.mark.skipif(
    not (pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm").exists(),
    reason="this Triton has no bundled ptxas / nvdisasm")


def test_fewer_barriers_with_one_gather_and_x_pairs():
    """The multiply-add expert kernel's main loop, found and measured: one gather for both nibbles and x read as
    pairs leave it fewer shared-memory barriers a step than one gather per nibble, and no build spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # the checkout under test, installed or not
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TOOL.parents[1]), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, str(TOOL), "--only", "gate_up", "--configs", "lookup1,lookup3+x_pairs"],
                         capture_output=True, text=True, env=env, timeout=300, check=True).stdout
    rows = {}
    for line in out.splitlines():
        if line.startswith("experts T=1 "):
            name, fields = line.split("_gate_up_silu_nf4_kernel")
            loop, per_weight, barriers, lds, spills, *_ = fields.split()
            rows[name.strip()] = (int(loop), float(per_weight), int(barriers), int(spills))
    default, fewer = rows["experts T=1 lookup1"], rows["experts T=1 lookup3+x_pairs"]
    assert default[0] > 100 and 3 < default[1] < 12  # a loop that multiplies weights, not a stray branch
    assert 0 < fewer[2] < default[2]
    assert all(r[3] == 0 for r in rows.values()), rows
