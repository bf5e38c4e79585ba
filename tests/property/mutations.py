"""The byte mutations the decoder fuzz tests share: a valid encoding with a few random
flips, cuts, insertions, extensions, or one of the protocol's huge numbers planted where
a count or length might be (the numbers are the protocol's own: each encodes lengths its
own way)."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st


@st.composite
def mutated(
    draw: st.DrawFn, valid: bytes, huge_numbers: Sequence[bytes], *, splice: bool = False
) -> bytes:
    """``valid`` mutated 1 to 4 times. A huge number overwrites the bytes where it lands
    or, with ``splice``, is inserted there (for variable-length encodings, where
    overwriting would mostly cut a number in two)."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "extend", "huge"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif op == "truncate":
            del data[at:]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif op == "extend":
            data += draw(st.binary(min_size=1, max_size=16))
        elif op == "huge":
            number = draw(st.sampled_from(huge_numbers))
            data[at : at if splice else at + len(number)] = number
    return bytes(data)
