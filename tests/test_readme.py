"""Every Python block of README.md runs, in order and in one namespace (as a reader pasting them
one after the other would), with the bundled model, so the README stays true. A block is
skipped only when the line before it says ``<!-- README test: skip (why) -->``."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(?:^(?P<mark><!-- README test: skip[^\n]*-->)\n)?^```python\n(?P<code>.*?)^```",
                   re.MULTILINE | re.DOTALL)


def python_blocks() -> list[tuple[str, bool]]:
    """The README's Python blocks, each with whether it is marked to be skipped."""
    return [(m["code"], m["mark"] is not None) for m in BLOCK.finditer(README.read_text())]


def test_the_readmes_python_blocks_run_with_the_bundled_model(tmp_path, monkeypatch):
    blocks = python_blocks()
    assert len(blocks) >= 4 and sum(skipped for _, skipped in blocks) <= 1
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for number, (code, skipped) in enumerate(blocks, 1):
            if not skipped:
                exec(compile(code, f"README.md python block {number}", "exec"), namespace)
    # What the blocks made: an answer, logits for the prompt, streamed text.
    assert namespace["results"][1].text.strip()
    assert namespace["logits"].shape == (1, len(namespace["prompt_ids"]),
                                         namespace["model"].config.vocab_size)
    assert not namespace["engine"].has_unfinished()
    assert "####" in printed.getvalue()  # the worked answers' final-answer mark
