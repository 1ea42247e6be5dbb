"""Running `eagle-export` in-process for the CLI tests (test_cli, test_bench, test_tune): one copy of the checks."""

from __future__ import annotations

from click.testing import CliRunner, Result

from eagle_export.cli import main


def cli(*args) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def ok(*args) -> Result:
    r = cli(*args)
    assert r.exception is None and r.exit_code == 0, r.output
    return r


def fail(*args, expect: tuple[str, ...]) -> str:
    """The command must exit 2 with one `error: ...` line on stderr holding every fragment."""
    r = cli(*args)
    assert r.exit_code == 2, r.output
    assert isinstance(r.exception, SystemExit), repr(r.exception)  # not an escaped exception
    assert "Traceback" not in r.output
    msg = r.stderr
    for f in expect:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg
