"""An experiment on the decode round's ladders: the processed rows (layers 0-1 and the eviction)
compacted into buckets of a ladder of their own, the retained rows keeping the engine's (the
engine uses one ladder for both). Fewer processed rungs mean fewer branches to compile in the
round's processed-row switches; the padding they add is in layers 0-1 only.

    python3 scripts/processed_ladder.py 0.125,0.25,0.375,0.5,0.75,1.0 -- bench --geometry sdar-8b ...

runs ``focus-jax`` (the arguments after ``--``) with that processed ladder; other scripts call
:func:`use` (``scripts/compile_round_time.py --processed-ladder``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence


def use(fractions: Sequence[float]) -> None:
    """Engines built from now on compact their processed rows into buckets of ``fractions`` of
    the full bucket (none smaller than the retained ladder's smallest)."""
    from focus_jax.compaction import bucket_ladder
    from focus_jax.engine import core

    settings_of = core.decode_settings

    def decode_settings(*args, **kwargs):
        settings = settings_of(*args, **kwargs)
        full, smallest = settings.retained_ladder[-1], settings.retained_ladder[0]
        return dataclasses.replace(
            settings, processed_ladder=bucket_ladder(full, tuple(fractions), minimum=smallest))

    core.decode_settings = decode_settings


def main(argv: Sequence[str]) -> int:
    if len(argv) < 2 or argv[1] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    use([float(f) for f in argv[0].split(",")])
    from focus_jax.cli import main as focus_jax

    return focus_jax(list(argv[2:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
