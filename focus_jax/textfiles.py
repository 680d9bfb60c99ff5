"""Reading the text files a user hands in (prompt lists, training data), with errors that name
the file and line."""

from __future__ import annotations

from pathlib import Path

from focus_jax.config import ConfigError


def read_lines(path: Path, expected: str) -> tuple[list[str], bytes]:
    """The lines of a UTF-8 text file and its bytes. A missing file, a folder or bytes that are
    not UTF-8 are a ``ConfigError`` naming the file (and line); ``expected`` says what the file
    should be ("a text file with one prompt per line")."""
    if not path.is_file():
        raise ConfigError(f"{path} {'is a folder' if path.is_dir() else 'does not exist'}: give "
                          f"{expected}")
    content = path.read_bytes()
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as err:
        line = content[:err.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text") from None
    # Split on newlines only: str.splitlines also splits at U+2028 and other separators.
    return [line.rstrip("\r") for line in text.split("\n")], content
