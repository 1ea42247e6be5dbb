"""tools/lab/chain_ab: the three runtimes side by side on the same prompts, every output checked against plain
decoding's (its timings are for reading, not asserted)."""

from __future__ import annotations

from chain_ab import main
from click.testing import CliRunner


def test_prints_both_guarded_runtimes_against_plain_decoding(trained):
    res = CliRunner().invoke(main, [str(trained("eagle1")), "--count", "2", "--max-new-tokens", "8", "--passes", "1",
                                    "--threads", "1"])
    assert res.exit_code == 0, res.output
    assert "guarded, short" in res.output and "guarded, base only" in res.output
    assert "with the short chain over without" in res.output
