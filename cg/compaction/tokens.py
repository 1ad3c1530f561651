"""The one token estimator cg uses everywhere: thresholds, "is it shorter", savings figures.

A real BPE tokenizer costs a download and a per-piece Python loop; this is a linear model over
counts the C string methods make cheaply: the UTF-8 bytes are mapped to a few character classes
(bytes.translate) and counted (bytes.count): words, case changes, numbers, punctuation, line
breaks, indentation, multi-byte characters. The weights were fitted (non-negative least squares on
relative error) against cl100k_base; docs/compaction-notes.md has the error table and the bound.
"""

import functools


def _class_table(*classes: tuple[bytes, bytes]) -> bytes:
    """A bytes.translate table sending each byte of a group to its class letter, the rest to '.'."""
    table = bytearray(b"." * 256)
    for members, letter in classes:
        for byte in members:
            table[byte] = ord(letter)
    return bytes(table)


_LETTERS = bytes(range(ord("A"), ord("Z") + 1)) + bytes(range(ord("a"), ord("z") + 1))
_DIGITS = b"0123456789"
_PUNCTUATION = bytes(b for b in range(0x21, 0x7F) if b not in _LETTERS + _DIGITS)
_LEADS_2, _LEADS_3, _LEADS_4 = bytes(range(0xC0, 0xE0)), bytes(range(0xE0, 0xF0)), bytes(range(0xF0, 0x100))

# (class table, ((pattern to count, weight), ...)); "." is every byte outside the table's classes.
_MODEL = (
    (_class_table((_LETTERS, b"a")), ((b".a", 0.6649),)),  # words
    (_class_table((_LETTERS[:26], b"u"), (_LETTERS[26:], b"l")),  # case changes: camelCase, base64
     ((b"lu", 0.6697), (b"uu", 0.4425), (b"ul", 0.9303))),
    (_class_table((_DIGITS, b"0")), ((b".0", 1.8325),)),  # numbers
    (_class_table((_LETTERS, b"a"), (_PUNCTUATION, b"p")), ((b"pa", 0.3655),)),  # "/usr", ".py", "_name"
    (_class_table((_PUNCTUATION, b"p")), ((b".p", 0.3186), (b"pp", 0.3376))),  # punctuation runs, pairs
    (_class_table((b"\n\r", b"n")), ((b".n", 0.1693),)),  # line breaks
    (_class_table((b" ", b"s")), ((b".s", 0.4244), (b".ss", 1.5853))),  # spaces, indentation
    (_class_table((b"\t", b"t"), (_LEADS_2, b"2"), (_LEADS_3, b"3"), (_LEADS_4, b"4")),
     ((b"t", 0.4874), (b"2", 0.4144), (b"3", 0.9236), (b"4", 2.7666))),  # tabs, multi-byte characters
)


def _counts(data: bytes) -> list[int]:
    """The model's features, in _MODEL order."""
    counts: list[int] = []
    for table, patterns in _MODEL:
        classes = data.translate(table)
        counts += (classes.count(pattern) for pattern, _ in patterns)
    return counts


_WEIGHTS = [weight for _, patterns in _MODEL for _, weight in patterns]


@functools.lru_cache(maxsize=8)  # components re-estimate the text the pipeline has just estimated
def estimate_tokens(text: str) -> int:
    """Roughly how many tokens text costs (cl100k_base-like; see the module docstring)."""
    if not text:
        return 0
    data = text.encode("utf-8", "surrogatepass")
    return max(1, round(sum(weight * count for weight, count in zip(_WEIGHTS, _counts(data)))))


# Bytes per token of a whole request body, for figures where running the estimator would cost
# too much (about 26 ms per MB on the reactor thread, several times cg's whole warm rewrite).
# The estimator finds 2.8 to 3.5 on long Claude Code sessions (bench/rewrite.py's bodies, where
# tool output dominates) and 5.4 on a fresh session's 77 KB (mostly the system prompt's prose).
BODY_BYTES_PER_TOKEN = 3.0


def estimate_body_tokens(size: int) -> int:
    """Roughly how many tokens a request body of `size` bytes costs, from its length alone."""
    return round(size / BODY_BYTES_PER_TOKEN)
