"""The test's prompts: token id lists from a seeded generator.

Every use gets prompts of its own (a name and an index pick the seed): D
keeps what it received in its prefix cache, so a prompt D has seen before
would be answered from there, not from P.
"""

from __future__ import annotations

import random
import zlib

import make_model

#: Token ids of words (past the special tokens: no end-of-sequence inside a prompt).
FIRST_WORD = len(make_model.SPECIAL)
LAST_WORD = FIRST_WORD + make_model.NUM_WORDS - 1

#: The P/D checks' prompt lengths: 200 to 2,000 tokens, short of one
#: 128-token block and many blocks, the longest one prefill chunk (2,048).
LENGTHS = (200, 333, 512, 700, 1024, 1300, 1700, 2000)


def prompt(name: str, index: int, length: int) -> list[int]:
    rng = random.Random(zlib.crc32(f"{name}/{index}/{length}".encode()))
    return [rng.randint(FIRST_WORD, LAST_WORD) for _ in range(length)]


def prompt_set(name: str, lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    return [prompt(name, index, length) for index, length in enumerate(lengths)]
