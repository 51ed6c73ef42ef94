"""The command line's documentation: the CLI page and the ``cli`` docstring name every option and exit
code, say what TARGET is, and every error shown on the page is the command's current output."""

from __future__ import annotations

import io
import re
import shlex
from pathlib import Path

import pytest

import packedinit.cli.command as cli
from packedinit.cli.command import (
    EXIT_CANNOT_TELL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PACKED,
    EXIT_REFUSED,
    EXIT_USAGE,
    main,
)

PAGE = Path(__file__).resolve().parent.parent / "docs" / "pages" / "cli.md"


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(argv, stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def shown_errors() -> list[tuple[str, str, int | None]]:
    """Every ``$ python -m packedinit ...`` on the page whose shown output is an error, with the exit code shown."""
    found: list[tuple[str, str, int | None]] = []
    for block in re.findall(r"```text\n(.*?)```", PAGE.read_text(), flags=re.DOTALL):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("$ python -m packedinit ") and lines[i + 1].startswith("packedinit: error: "):
                code = int(lines[i + 3]) if i + 3 < len(lines) and lines[i + 2] == "$ echo $?" else None
                found.append((line[2:], lines[i + 1], code))
    return found


def help_options() -> set[str]:
    code, out, _ = run(["audit", "--help"])
    assert code == EXIT_OK
    options = out[out.index("options:") :].split("\n\n")[0]
    return set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", options))


def test_the_page_shows_many_errors() -> None:
    commands = [c for c, _, _ in shown_errors()]
    assert len(commands) >= 8
    assert any("n_layr" in c for c in commands)
    assert any("sys:exit" in c for c in commands)


@pytest.mark.parametrize(("command", "line", "code"), shown_errors())
def test_every_error_on_the_page_is_the_current_output(command: str, line: str, code: int | None) -> None:
    got_code, out, err = run(shlex.split(command)[3:])
    assert out == ""
    assert err == line + "\n"
    assert got_code == EXIT_USAGE
    if code is not None:
        assert got_code == code


def test_the_page_says_target_is_code_and_values_are_literals() -> None:
    text = " ".join(PAGE.read_text().split())
    assert "**`TARGET` is imported and called**, exactly as `python -c" in text
    assert "Never pass a target you would not run" in text
    assert "**The values are literals only**" in text
    assert "`ast.literal_eval` (never `eval`)" in text


def test_every_option_is_documented_on_the_page_and_in_the_docstring() -> None:
    options = help_options()
    assert options == {"-h", "--help", "--init", "--json", "--meta", "--seed", "--check"}
    text = PAGE.read_text()
    table = text[text.index("| option | effect |") : text.index("### Exit codes")]
    first_cells = re.findall(r"^\| ([^|]*) \|", table, flags=re.MULTILINE)
    documented = {o for cell in first_cells for o in re.findall(r"`(--?[a-z-]+)", cell)}
    assert options <= documented
    doc = cli.__doc__ or ""
    for option in options | {"--version"}:
        assert re.search(rf"``(packedinit )?{option}\b", doc), option
    for option in options - {"-h", "--help"}:
        assert option in (cli.main.__doc__ or ""), option


def test_every_exit_code_is_documented() -> None:
    codes = {EXIT_OK, EXIT_PACKED, EXIT_USAGE, EXIT_REFUSED, EXIT_CANNOT_TELL, EXIT_INTERRUPTED}
    assert codes == {0, 1, 2, 3, 4, 130}
    text = PAGE.read_text()
    table = text[text.index("| code | meaning |") :].split("\n\n")[0]
    assert {int(c) for c in re.findall(r"^\| (\d+) \|", table, flags=re.MULTILINE)} == codes
    doc = cli.__doc__ or ""
    for c in codes:
        assert f"* {c}: " in doc, c
    _, out, _ = run(["audit", "--help"])
    for c in codes:
        assert re.search(rf"\b{c} ", " ".join(out.split())), c
