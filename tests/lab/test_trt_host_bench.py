"""tools/lab/trt_host_bench: the TensorRT backend's host work per call, on the emulator (figures printed, not
asserted)."""

from __future__ import annotations

from click.testing import CliRunner
from trt_host_bench import main


def test_trt_host_bench_prints_its_figures(engines):
    res = CliRunner().invoke(main, [str(engines("fp32")), "--new-tokens", "8"])
    assert res.exit_code == 0, res.output
    assert "median host us per call: target_verify" in res.output
    assert "set_tensor_address 0.0, get_tensor_shape 0.0" in res.output  # the third run sets no address
