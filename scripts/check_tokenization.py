"""Does transformers' "incorrect regex pattern ... This will lead to incorrect tokenization"
warning apply to our tokenizers? Token ids of a few hundred varied strings (whitespace runs,
digits, contractions, unicode, code), four ways per tokenizer folder:

- ``ours``: ``focus_jax.checkpoint.load_tokenizer`` (what ``focus_jax.load`` uses);
- ``reference``: for the bundled model, ``tokenizers.Tokenizer.from_file`` on its tokenizer.json
  (the file as written); for the SDAR (Qwen2) folder, a byte-level BPE written here from
  vocab.json and merges.txt with Qwen2's pre-tokenization pattern and NFC (independent of
  transformers and of the tokenizers library);
- ``auto``: ``AutoTokenizer.from_pretrained`` as it loads by default (the warning's path);
- ``fixed``: ``AutoTokenizer.from_pretrained(..., fix_mistral_regex=True)``, what the warning
  advises.

Per folder: whether loading warned, and how many strings each way encodes differently from the
reference. The SDAR folder is built from the SDAR-8B-Chat tokenizer files that
``../shared/peer/sdar_tokenizer`` holds (vocab.json, merges.txt, tokenizer_config.json), with a
config.json with and without ``transformers_version`` (the warning depends on it).

    .venv/bin/python scripts/check_tokenization.py --sdar ../shared/peer/sdar_tokenizer
"""

from __future__ import annotations

import argparse
import functools
import gzip
import io
import itertools
import json
import logging
import random
import shutil
import tempfile
import unicodedata
from pathlib import Path

import regex

from focus_jax.bundled import MODEL
from focus_jax.checkpoint import load_tokenizer

# Qwen2's pre-tokenization (its tokenizer.json's Split pattern).
QWEN2_PATTERN = regex.compile(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
FRAGMENTS = (
    "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "    \n", "\t\t x", "a  b   c",
    "12345", "3.14159", "1,000,000", "2+2=4", "007", "x1y22z333", "-42", "1e-5",
    "I'm", "you're", "DON'T", "it's", "we'll", "they'd", "I've", "She'S", "o'clock", "'twas",
    "naïve café", "日本語のテキスト", "Здравствуйте, мир", "😀👍🏽", "e\u0301", "ﬁ ligature", "straße",
    "العربية", "한국어 문장", "Ωmega ≈ 3", "…", "¿Qué?", "ÅNGSTRÖM",
    "def f(x):\n    return x**2", "for (int i=0;i<n;++i){}", "x = {'a': [1, 2]}",
    "if a != b && c <= d:", "#include <stdio.h>", "SELECT * FROM t WHERE id=1;",
    "https://example.com/a?b=c", "C:\\path\\to\\file", "snake_case camelCase PascalCase",
    "Hello, World!", "The quick brown fox.", "Add: 257+468", "Reverse: p a l l a s",
)


def strings(count: int, seed: int = 0) -> list[str]:
    """Every fragment alone, then random joins of 2-5 fragments and separators."""
    rng = random.Random(seed)
    out = list(FRAGMENTS)
    while len(out) < count:
        parts = [rng.choice(FRAGMENTS) for _ in range(rng.randint(2, 5))]
        out.append("".join(p + rng.choice(("", " ", "  ", "\n", "\t", ", ")) for p in parts))
    return out


@functools.cache
def byte_to_unicode() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte (the GPT-2 scheme Qwen2 uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class ByteLevelBPE:
    """Qwen2's tokenization from its vocab.json and merges.txt (special tokens aside)."""

    def __init__(self, folder: Path):
        self.vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
        merges = (folder / "merges.txt").read_text(encoding="utf-8").split("\n")
        if merges[0].startswith("#version"):
            merges = merges[1:]  # a header (a merge may start with "#": "# include")
        pairs = [tuple(line.split(" ")) for line in merges if line]
        self.rank = {pair: i for i, pair in enumerate(pairs)}

    def encode(self, text: str) -> list[int]:
        table = byte_to_unicode()
        ids = []
        for piece in QWEN2_PATTERN.findall(unicodedata.normalize("NFC", text)):
            symbols = [table[b] for b in piece.encode("utf-8")]
            while len(symbols) > 1:
                ranked = [(self.rank.get(pair, len(self.rank)), i)
                          for i, pair in enumerate(itertools.pairwise(symbols))]
                best, at = min(ranked)
                if best == len(self.rank):
                    break
                symbols[at:at + 2] = [symbols[at] + symbols[at + 1]]
            ids += [self.vocab[s] for s in symbols]
        return ids


def loaded_with_warnings(load) -> tuple[object, list[str]]:
    """``load()``'s tokenizer and the transformers warnings it logged."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        tokenizer = load()
    finally:
        logger.removeHandler(handler)
    return tokenizer, [line for line in stream.getvalue().splitlines() if line.strip()]


def compare(folder: Path, reference, texts: list[str]) -> dict:
    from transformers import AutoTokenizer

    ways = {"ours": lambda: load_tokenizer(folder),
            "auto": lambda: AutoTokenizer.from_pretrained(str(folder), local_files_only=True),
            "fixed": lambda: AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                                           fix_mistral_regex=True)}
    expected = [reference(t) for t in texts]
    report = {}
    for name, load in ways.items():
        tokenizer, warnings = loaded_with_warnings(load)
        got = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        differ = [t for t, a, b in zip(texts, got, expected, strict=True) if a != b]
        report[name] = {"warned": any("incorrect regex pattern" in w for w in warnings),
                        "differ": len(differ), "examples": differ[:3]}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdar", type=Path, default=None,
                        help="a folder with SDAR's vocab.json(.gz), merges.txt(.gz) and "
                             "tokenizer_config.json")
    parser.add_argument("--strings", type=int, default=400)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    texts = strings(args.strings)
    from tokenizers import Tokenizer

    bundled = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    report = {"strings": len(texts),
              "bundled": compare(MODEL, lambda t: bundled.encode(t, add_special_tokens=False).ids,
                                 texts)}
    if args.sdar:
        with tempfile.TemporaryDirectory() as tmp:
            for version in (None, "4.52.4"):
                folder = Path(tmp) / f"sdar-{version}"
                folder.mkdir()
                for name in ("vocab.json", "merges.txt", "tokenizer_config.json",
                             "special_tokens_map.json"):
                    if (args.sdar / name).exists():
                        shutil.copy2(args.sdar / name, folder / name)
                    elif (args.sdar / f"{name}.gz").exists():
                        (folder / name).write_bytes(gzip.decompress(
                            (args.sdar / f"{name}.gz").read_bytes()))
                config = {"model_type": "sdar", "architectures": ["SDARForCausalLM"]}
                if version:
                    config["transformers_version"] = version
                (folder / "config.json").write_text(json.dumps(config))
                qwen2 = ByteLevelBPE(folder)
                report[f"sdar, config transformers_version {version}"] = compare(
                    folder, qwen2.encode, texts)
    print(json.dumps(report, indent=1, ensure_ascii=False))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
