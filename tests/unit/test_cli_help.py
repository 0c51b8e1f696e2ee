"""``deltarl --help``: every sub-command's summary reads as one paragraph, however its docstring
is wrapped in the source."""

from __future__ import annotations

from typer.testing import CliRunner

from deltarl.cli import SUBCOMMANDS, app, command_help


def test_command_help_joins_the_first_paragraph_only() -> None:
    doc = """Run it: a summary wrapped
    over two lines.

    Settings:

      DELTARL_X (default 1): kept
        as written."""
    assert command_help(doc) == (
        "Run it: a summary wrapped over two lines.\n\nSettings:\n\n  DELTARL_X (default 1): kept\n"
        "    as written."
    )
    assert command_help(None) is None
    assert command_help("One line.") == "One line."


def test_every_summary_in_the_command_list_is_one_line_at_a_wide_terminal() -> None:
    out = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "400"}).output
    rows = [line for line in out.splitlines() if line.startswith("│ ")]
    names = [name for name, _, _ in SUBCOMMANDS]
    for name in names:
        (row,) = [r for r in rows if r[2:].split(" ", 1)[0] == name]
        i = rows.index(row)
        # the next row starts another command (or the panel ends): nothing wrapped onto it
        assert i + 1 == len(rows) or rows[i + 1][2:].split(" ", 1)[0] in names, (name, rows[i + 1])
    for name in ("demo", "run", "worker-token"):  # their docstrings wrap in the source
        (row,) = [r for r in rows if r[2:].split(" ", 1)[0] == name]
        assert row.rstrip(" │").endswith(("curve.", "weights.", "TOKEN.")), row
