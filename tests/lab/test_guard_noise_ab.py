"""tools/lab/guard_noise_ab: one runtime per window on the same prompts, every EAGLE output checked against its
plain twin's (its timings are for reading, not asserted), each runtime's cost figures over the window it was given."""

from __future__ import annotations

from click.testing import CliRunner
from guard_noise_ab import main


def test_prints_each_window_against_plain_decoding(trained):
    res = CliRunner().invoke(main, [str(trained("eagle1")), "--window", "9", "--window", "33", "--passes", "1",
                                    "--max-new-tokens", "8", "--threads", "1"])
    assert res.exit_code == 0, res.output
    assert "window   9:" in res.output and "window  33:" in res.output
    assert "paying requests run mostly plain" in res.output
