"""A bounded bin_prot codec: the subset of Jane Street's binary format that Ripple uses.

The rules below are those of bin_prot's own ``write.ml`` / ``read.ml`` on a 64-bit
platform (an OCaml ``int`` is 63 bits there). Multi-byte numbers are little-endian.

Integers (``int``, and ``Int64.t`` which bin_prot writes with the very same scheme):

=========================================  ==========================================
value ``n``                                bytes written (the shortest form)
=========================================  ==========================================
``0 <= n <= 0x7f``                         one byte ``n``
``-0x80 <= n <= -1``                       ``ff`` + one signed byte
``0x80 <= n <= 0x7fff``                    ``fe`` + 2-byte signed LE
``-0x8000 <= n <= -0x81``                  ``fe`` + 2-byte signed LE
``0x8000 <= n <= 0x7fff_ffff``             ``fd`` + 4-byte signed LE
``-0x8000_0000 <= n <= -0x8001``           ``fd`` + 4-byte signed LE
anything wider                             ``fc`` + 8-byte signed LE
=========================================  ==========================================

So 0 -> ``00``, 127 -> ``7f``, 128 -> ``fe 80 00``, -1 -> ``ff ff``, -129 -> ``fe 7f ff``,
65536 -> ``fd 00 00 01 00``, 2**31 -> ``fc 00 00 00 80 00 00 00 00``. An ``int`` must lie
in OCaml's range ``-2**62 .. 2**62-1``; an ``int64`` in ``-2**63 .. 2**63-1``. The two
encodings only differ in that range: an ``fc`` int outside OCaml's range is an error for
``int`` (bin_prot's Int_overflow) and fine for ``int64``.

``nat0`` (lengths and counts; never negative): ``0 .. 0x7f`` one byte; ``0x80 .. 0xffff``
``fe`` + 2-byte unsigned; ``0x1_0000 .. 0xffff_ffff`` ``fd`` + 4-byte unsigned; larger
``fc`` + 8-byte unsigned, at most ``2**62-1``. (65536 as nat0 is also ``fd 00 00 01 00``;
128 is ``fe 80 00``; 40000 is ``fe 40 9c``, where the int encoding needs ``fd``.)

Decoding follows bin_prot's reader exactly, including its leniency: a number written in
a wider form than needed (``fe 05 00`` for 5) is accepted; an ``ff`` int byte that is not
negative is refused (bin_prot's Neg_int8), as are the lead bytes ``80 .. fb`` (and ``ff``
for nat0), an ``fc`` nat0 above ``2**62-1`` and an ``fc`` int outside OCaml's range. The
encoder always writes the shortest form, so it is canonical.

Everything else:

- ``float``: the 8 bytes of the IEEE-754 double, little-endian (NaN payloads preserved).
- ``bool``: one byte, ``00`` false, ``01`` true; any other byte is an error. ``unit``: ``00``.
- ``string``: nat0 byte length, then the bytes. :data:`STRING` is UTF-8 text (invalid
  UTF-8 is a decode error); :data:`BYTES` is the same wire form kept as raw ``bytes``.
- ``'a option``: ``00`` for None, ``01`` then the value; any other byte is an error.
- ``'a list``: nat0 count, then the items in order.
- tuples and records: the fields in declaration order, nothing around them.
- variants: one byte, the constructor's index in declaration order (whether or not the
  constructor has arguments), then the arguments (an inline record's fields in order).
  bin_prot switches to a 2-byte index past 256 constructors; this codec refuses to
  declare such a variant.

Bounds: a decoder never trusts a length. A string length or list count is checked
against the bytes that remain (a list item takes at least :attr:`Codec.min_size` bytes)
before anything is sliced, allocated or looped over, so decoding costs at most work
proportional to the input. Every failure is a :class:`DecodeError` (a
:class:`~headwater.errors.ProtocolError`); values the wire cannot carry (an ``int`` out of
range, an undeclared constructor) make the encoders raise
:class:`~headwater.errors.UsageError`.

The combinators (:func:`option`, :func:`list_of`, :func:`pair`, :func:`record`,
:func:`variant`, :func:`enumeration`, :func:`mapped`) build a :class:`Codec` from smaller
ones, so a record type is declared once and both directions come from that declaration.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Generic, TypeAlias, TypeVar

from headwater.engine.kinds.reader import BoundedReader
from headwater.engine.kinds.reader import Buffer as Buffer
from headwater.errors import ProtocolError, UsageError

T = TypeVar("T")
U = TypeVar("U")
A = TypeVar("A")
B = TypeVar("B")
E = TypeVar("E", bound=IntEnum)

CODE_NEG_INT8 = 0xFF
CODE_INT16 = 0xFE
CODE_INT32 = 0xFD
CODE_INT64 = 0xFC

INT_MIN = -(2**62)
"""Smallest OCaml ``int`` on a 64-bit platform."""
INT_MAX = 2**62 - 1
"""Largest OCaml ``int`` on a 64-bit platform (also the largest ``nat0``)."""
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
NAT0_MAX = INT_MAX

MAX_DEPTH = 64
"""Deepest nesting :meth:`Reader.enter` allows (recursive types such as sexp)."""

_F64 = struct.Struct("<d")
_TAG_I16 = struct.Struct("<Bh")
_TAG_I32 = struct.Struct("<Bi")
_TAG_I64 = struct.Struct("<Bq")
_TAG_U16 = struct.Struct("<BH")
_TAG_U32 = struct.Struct("<BI")
_TAG_U64 = struct.Struct("<BQ")


class DecodeError(ProtocolError):
    """Bytes that are not a well-formed bin_prot value of the expected type.

    ``offset`` is where in the decoded buffer the problem was found (None when unknown).
    """

    def __init__(self, message: str, offset: int | None = None) -> None:
        super().__init__(message if offset is None else f"{message} (at offset {offset})")
        self.message = message
        self.offset = offset

    def within(self, context: str) -> DecodeError:
        """The same error with ``context`` (where in the value it happened) prefixed."""
        return type(self)(f"{context}: {self.message}", self.offset)


# --- reading -------------------------------------------------------------------------


class Reader(BoundedReader):
    """The bounded reader with bin_prot's numbers, strings, options, lists and variant
    tags on top; its errors are :class:`DecodeError` with the offset of the bad value."""

    __slots__ = ("depth",)

    def __init__(self, data: Buffer, pos: int = 0) -> None:
        # The base's fields set here, not through super(): one reader per decoded value.
        self.buf = data if isinstance(data, bytes) else memoryview(data).cast("B")
        self.pos = pos
        self.end = len(self.buf)
        self.error = DecodeError
        self.depth = 0

    def fail(self, message: str, at: int) -> DecodeError:
        return DecodeError(message, at)

    def short(self, n: int, what: str) -> DecodeError:
        pos = self.pos
        return DecodeError(f"truncated {what}: needs {n} bytes, {self.end - pos} left", pos)

    byte = BoundedReader.u8

    def _number(self, what: str, forms: dict[int, struct.Struct], noun: str) -> int:
        """A number in bin_prot's prefixed form: a byte below 0x80 is the value, else it
        names the width that follows (one of ``forms``)."""
        start = self.pos
        if start >= self.end:
            self.u8(what)  # raises: truncated
        code: int = self.buf[start]
        self.pos = start + 1
        if code < 0x80:
            return code
        form = forms.get(code)
        if form is None:
            raise DecodeError(f"{what}: byte {code:#04x} cannot start {noun}", start)
        value: int = form.unpack_from(self.buf, self.need(form.size, what))[0]
        if code == CODE_NEG_INT8 and value >= 0:
            raise DecodeError(f"{what}: int8 form {value} after ff is not negative", start)
        return value

    def nat0(self, what: str) -> int:
        start = self.pos
        value = self._number(what, _NAT0_FORMS, "a nat0")
        if value > NAT0_MAX:
            raise DecodeError(f"{what}: nat0 {value} exceeds {NAT0_MAX}", start)
        return value

    def _compact(self, what: str) -> int:
        return self._number(what, _INT_FORMS, "an integer")

    def int_(self, what: str) -> int:
        start = self.pos
        value = self._compact(what)
        if not INT_MIN <= value <= INT_MAX:
            raise DecodeError(f"{what}: {value} does not fit an OCaml int", start)
        return value

    def int64(self, what: str) -> int:
        return self._compact(what)

    float_ = BoundedReader.f64

    def _zero_or_one(self, what: str, form: str) -> bool:
        start = self.pos
        code = self.u8(what)
        if code > 1:
            raise DecodeError(f"{what}: {form} byte {code:#04x} is neither 00 nor 01", start)
        return code == 1

    def bool_(self, what: str) -> bool:
        return self._zero_or_one(what, "bool")

    def option_tag(self, what: str) -> bool:
        """True when an option holds a value (``01``), False for None (``00``)."""
        return self._zero_or_one(what, "option")

    def unit(self, what: str) -> None:
        start = self.pos
        code = self.u8(what)
        if code != 0:
            raise DecodeError(f"{what}: unit byte {code:#04x} is not 00", start)

    def bytes_(self, what: str) -> bytes:
        return self.take(self.nat0(f"{what} length"), what)

    def string(self, what: str) -> str:
        start = self.pos
        return self.text(self.nat0(f"{what} length"), what, start)

    def count(self, what: str, min_item_size: int = 1) -> int:
        """A list's nat0 count, refused when that many items cannot fit in what remains."""
        start = self.pos
        return self.fits(self.nat0(f"{what} count"), max(min_item_size, 1), what, start)

    def tag(self, what: str, constructors: int) -> int:
        """A variant's one-byte constructor index, refused unless below ``constructors``."""
        start = self.pos
        code = self.u8(what)
        if code >= constructors:
            raise DecodeError(
                f"{what}: constructor {code} is not one of the {constructors} declared", start
            )
        return code

    def enter(self, what: str, max_depth: int = MAX_DEPTH) -> None:
        """Go one level deeper into a recursive value; refused past ``max_depth``."""
        if self.depth >= max_depth:
            raise DecodeError(f"{what} nested deeper than {max_depth} levels", self.pos)
        self.depth += 1

    def leave(self) -> None:
        self.depth -= 1


_NAT0_FORMS = {
    CODE_INT16: struct.Struct("<H"),
    CODE_INT32: struct.Struct("<I"),
    CODE_INT64: struct.Struct("<Q"),
}
_INT_FORMS = {
    CODE_NEG_INT8: struct.Struct("<b"),
    CODE_INT16: struct.Struct("<h"),
    CODE_INT32: struct.Struct("<i"),
    CODE_INT64: struct.Struct("<q"),
}


# --- writing -------------------------------------------------------------------------


def _check_int(n: int, low: int, high: int, what: str) -> int:
    if not isinstance(n, int):
        raise UsageError(f"{what} must be an int, not {type(n).__name__}")
    if not low <= n <= high:
        raise UsageError(f"{what} {n} is outside {low}..{high}")
    return int(n)


def _compact_bytes(n: int) -> bytes:
    if 0 <= n < 0x80:
        return bytes((n,))
    if -0x80 <= n < 0:
        return bytes((CODE_NEG_INT8, n & 0xFF))
    if -0x8000 <= n < 0x8000:
        return _TAG_I16.pack(CODE_INT16, n)
    if -0x8000_0000 <= n < 0x8000_0000:
        return _TAG_I32.pack(CODE_INT32, n)
    return _TAG_I64.pack(CODE_INT64, n)


def nat0_bytes(n: int) -> bytes:
    """The nat0 encoding of ``n`` (UsageError outside ``0 .. 2**62-1``)."""
    _check_int(n, 0, NAT0_MAX, "nat0")
    if n < 0x80:
        return bytes((n,))
    if n < 0x1_0000:
        return _TAG_U16.pack(CODE_INT16, n)
    if n < 0x1_0000_0000:
        return _TAG_U32.pack(CODE_INT32, n)
    return _TAG_U64.pack(CODE_INT64, n)


def int_bytes(n: int) -> bytes:
    """The bin_prot ``int`` encoding of ``n`` (UsageError outside OCaml's int range)."""
    return _compact_bytes(_check_int(n, INT_MIN, INT_MAX, "int"))


def int64_bytes(n: int) -> bytes:
    """The bin_prot ``Int64.t`` encoding of ``n`` (the int scheme over 64 bits)."""
    return _compact_bytes(_check_int(n, INT64_MIN, INT64_MAX, "int64"))


class Writer:
    """Accumulates an encoding; :meth:`getvalue` returns the bytes."""

    __slots__ = ("_out",)

    def __init__(self) -> None:
        self._out = bytearray()

    def getvalue(self) -> bytes:
        return bytes(self._out)

    def __len__(self) -> int:
        return len(self._out)

    def raw(self, data: Buffer) -> None:
        self._out += data

    def byte(self, value: int) -> None:
        self._out.append(value)

    def nat0(self, n: int) -> None:
        self._out += nat0_bytes(n)

    def int_(self, n: int) -> None:
        self._out += int_bytes(n)

    def int64(self, n: int) -> None:
        self._out += int64_bytes(n)

    def float_(self, x: float) -> None:
        if isinstance(x, bool) or not isinstance(x, float | int):
            raise UsageError(f"float must be a float, not {type(x).__name__}")
        self._out += _F64.pack(float(x))

    def bool_(self, b: bool) -> None:
        if not isinstance(b, bool):
            raise UsageError(f"bool must be a bool, not {type(b).__name__}")
        self._out.append(1 if b else 0)

    def unit(self) -> None:
        self._out.append(0)

    def option_tag(self, present: bool) -> None:
        self._out.append(1 if present else 0)

    def bytes_(self, data: Buffer) -> None:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise UsageError(f"bytes must be a bytes-like object, not {type(data).__name__}")
        view = memoryview(data)
        self._out += nat0_bytes(view.nbytes)
        self._out += view

    def string(self, text: str) -> None:
        if not isinstance(text, str):
            raise UsageError(f"string must be a str, not {type(text).__name__}")
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise UsageError(f"string is not encodable as UTF-8 ({exc.reason})") from None
        self._out += nat0_bytes(len(data))
        self._out += data

    def tag(self, index: int) -> None:
        self._out.append(index)


# --- codecs --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Codec(Generic[T]):
    """Both directions of one bin_prot type.

    ``write`` appends a value to a :class:`Writer`; ``read`` takes one from a
    :class:`Reader`; ``min_size`` is the fewest bytes any value occupies (used to bound
    list counts before looping).
    """

    name: str
    write: Callable[[Writer, T], None]
    read: Callable[[Reader], T]
    min_size: int = 1

    def encode(self, value: T) -> bytes:
        w = Writer()
        self.write(w, value)
        return w.getvalue()

    def decode(self, data: Buffer) -> T:
        """Exactly one value filling ``data``; trailing bytes are an error."""
        r = Reader(data)
        value = self.read(r)
        r.finish(self.name)
        return value


def _primitive(
    name: str, write: Callable[[Writer, T], None], read: Callable[[Reader, str], T], size: int
) -> Codec[T]:
    return Codec(name, write, lambda r: read(r, name), size)


NAT0: Codec[int] = _primitive("nat0", Writer.nat0, Reader.nat0, 1)
INT: Codec[int] = _primitive("int", Writer.int_, Reader.int_, 1)
INT64: Codec[int] = _primitive("int64", Writer.int64, Reader.int64, 1)
FLOAT: Codec[float] = _primitive("float", Writer.float_, Reader.float_, 8)
BOOL: Codec[bool] = _primitive("bool", Writer.bool_, Reader.bool_, 1)
STRING: Codec[str] = _primitive("string", Writer.string, Reader.string, 1)
BYTES: Codec[bytes] = _primitive("string", Writer.bytes_, Reader.bytes_, 1)
UNIT: Codec[None] = Codec("unit", lambda w, _v: w.unit(), lambda r: r.unit("unit"), 1)


def option(codec: Codec[T]) -> Codec[T | None]:
    """``'a option``: ``00`` for None, ``01`` then the value."""
    name = f"{codec.name} option"

    def write(w: Writer, value: T | None) -> None:
        if value is None:
            w.option_tag(False)
        else:
            w.option_tag(True)
            codec.write(w, value)

    def read(r: Reader) -> T | None:
        return codec.read(r) if r.option_tag(name) else None

    return Codec(name, write, read, 1)


def list_of(codec: Codec[T], max_len: int | None = None) -> Codec[tuple[T, ...]]:
    """``'a list``: nat0 count, then the items; decoded as a tuple.

    ``max_len`` (bin_prot's ``bin_read_list_with_max_len``) refuses longer lists on both
    sides: a DecodeError when reading, a UsageError when writing.
    """
    name = f"{codec.name} list"
    item_write, item_read, item_size = codec.write, codec.read, codec.min_size

    def write(w: Writer, items: Sequence[T]) -> None:
        if isinstance(items, str | bytes) or not isinstance(items, Sequence):
            raise UsageError(f"{name} must be a sequence, not {type(items).__name__}")
        if max_len is not None and len(items) > max_len:
            raise UsageError(f"{name}: {len(items)} items, at most {max_len} allowed")
        w.nat0(len(items))
        for item in items:
            item_write(w, item)

    def read(r: Reader) -> tuple[T, ...]:
        start = r.pos
        n = r.count(name, item_size)
        if max_len is not None and n > max_len:
            raise DecodeError(f"{name}: {n} items, at most {max_len} allowed", start)
        return tuple(item_read(r) for _ in range(n))

    return Codec(name, write, read, 1)


def pair(first: Codec[A], second: Codec[B]) -> Codec[tuple[A, B]]:
    """``'a * 'b``: the two components in order."""
    name = f"{first.name} * {second.name}"

    def write(w: Writer, value: tuple[A, B]) -> None:
        if not isinstance(value, tuple) or len(value) != 2:
            raise UsageError(f"{name} must be a 2-tuple, not {value!r}")
        first.write(w, value[0])
        second.write(w, value[1])

    def read(r: Reader) -> tuple[A, B]:
        return first.read(r), second.read(r)

    return Codec(name, write, read, first.min_size + second.min_size)


def mapped(codec: Codec[T], to: Callable[[T], U], back: Callable[[U], T], name: str) -> Codec[U]:
    """``codec`` seen through a conversion: decode gives ``to(value)``, encode ``back(u)``."""
    write_inner, read_inner = codec.write, codec.read

    def write(w: Writer, value: U) -> None:
        write_inner(w, back(value))

    def read(r: Reader) -> U:
        return to(read_inner(r))

    return Codec(name, write, read, codec.min_size)


def record(cls: Callable[..., T], *fields: tuple[str, Codec[Any]], name: str = "") -> Codec[T]:
    """A record: each field's encoding in declaration order, nothing around them.

    ``cls`` is called with the decoded fields positionally; encoding reads them back as
    attributes. When ``cls`` is a dataclass its init fields must be exactly ``fields``,
    in order (checked here, once), so the wire order cannot drift from the class.
    """
    label = name or getattr(cls, "__name__", "record")
    if dataclasses.is_dataclass(cls):
        declared = [f.name for f in dataclasses.fields(cls) if f.init]
        if declared != [field_name for field_name, _ in fields]:
            raise UsageError(f"{label}: wire fields {fields!r} do not match {declared}")
    parts = tuple((fname, codec.write, codec.read) for fname, codec in fields)

    def write(w: Writer, value: T) -> None:
        for fname, field_write, _ in parts:
            field_write(w, getattr(value, fname))

    def read(r: Reader) -> T:
        values = []
        for fname, _, field_read in parts:
            try:
                values.append(field_read(r))
            except DecodeError as exc:
                raise exc.within(f"{label}.{fname}") from None
        return cls(*values)

    return Codec(label, write, read, sum(codec.min_size for _, codec in fields))


Case: TypeAlias = tuple[type[Any], "Codec[Any] | None"]
"""A variant constructor: its class and the codec of its arguments (None: constant)."""


def variant(name: str, *cases: Case) -> Codec[Any]:
    """A variant: one byte (the constructor's index in ``cases``), then its arguments.

    A case's codec reads and writes the whole constructor value (e.g. a :func:`record`
    of the constructor's class for an inline record, or a :func:`mapped` codec that
    wraps a payload); a constant constructor has no codec and decodes as ``cls()``.
    Encoding picks the case whose class is exactly ``type(value)``.
    """
    if not 0 < len(cases) <= 256:
        raise UsageError(f"{name}: a one-byte variant has 1..256 constructors, not {len(cases)}")
    index = {cls: i for i, (cls, _) in enumerate(cases)}
    if len(index) != len(cases):
        raise UsageError(f"{name}: a class appears twice among the constructors")

    def write(w: Writer, value: Any) -> None:
        i = index.get(type(value))
        if i is None:
            raise UsageError(f"{type(value).__name__} is not a constructor of {name}")
        w.tag(i)
        codec = cases[i][1]
        if codec is not None:
            codec.write(w, value)

    def read(r: Reader) -> Any:
        cls, codec = cases[r.tag(name, len(cases))]
        return cls() if codec is None else codec.read(r)

    return Codec(name, write, read, 1)


def enumeration(enum: type[E], name: str = "") -> Codec[E]:
    """A variant of constant constructors mirrored by an IntEnum whose values are 0..n-1."""
    label = name or enum.__name__
    members = sorted(enum, key=int)
    if [int(m) for m in members] != list(range(len(members))) or not 0 < len(members) <= 256:
        raise UsageError(f"{label}: enum values must be 0..n-1 with n <= 256")

    def write(w: Writer, value: E) -> None:
        if not isinstance(value, enum):
            raise UsageError(f"{value!r} is not a {label}")
        w.tag(int(value))

    def read(r: Reader) -> E:
        return members[r.tag(label, len(members))]

    return Codec(label, write, read, 1)
