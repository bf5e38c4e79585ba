"""Messages declared by their fields: a frozen dataclass whose annotations say how each
field travels, and one layout compiled from them that writes and reads the whole payload.

A field annotated ``Annotated[T, wire]`` (usually through an alias: :data:`U16`,
:data:`U64`, a codec's ``Str16`` ...) travels as ``wire`` says, fields in declaration
order (the wire order). Runs of fixed-width fields (:class:`Fixed`, a ``struct`` code) are
packed and unpacked with one precompiled little-endian struct; variable-width fields
(:class:`Variable`: strings, blobs, lists) write and read themselves. Decoding keeps the
codecs' rules: every field is bounds-checked before it is read, and a payload too short
for a run of fixed fields is refused naming the first field that does not fit, exactly as
reading them one at a time would.

A subclass of :class:`Declared` gets ``_write(out)`` and ``_read(reader)`` compiled from
its layout (closures over the precompiled structs: as fast as the hand-written pairs they
replace). A message whose wire form is not a plain sequence of its fields (bit flags,
constants, optional sections) overrides them, and then its fields need no wire.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from enum import IntEnum
from operator import attrgetter
from typing import Annotated, Any, ClassVar, Generic, Self, TypeAlias, TypeVar, get_type_hints

from headwater.engine.kinds.reader import BoundedReader, Buffer

T = TypeVar("T")
E = TypeVar("E", bound=IntEnum)
D = TypeVar("D", bound="Declared")

Load: TypeAlias = Callable[[BoundedReader, Any, str, int], Any]
"""Read raw value -> field value: ``load(reader, raw, field name, offset)``; raises the
codec's decode error for a value the field cannot hold."""
Dump: TypeAlias = Callable[[Any, str], Any]
"""Field value -> raw value to pack: ``dump(value, field name)``; raises UsageError."""
_Writer: TypeAlias = Callable[[Any, list[Buffer]], None]
_Reader: TypeAlias = Callable[[BoundedReader], tuple[Any, ...]]


class Wire(Generic[T]):
    """How one field travels: ``read(reader, what)`` takes it, ``write(out, value, what)``
    appends its bytes (``what`` names the field in errors)."""

    __slots__ = ("read", "write")

    read: Callable[[Any, str], T]
    write: Callable[[list[Buffer], T, str], None]


class Fixed(Wire[T]):
    """A fixed-width field: one little-endian ``struct`` code, with an optional ``load``
    (check or convert what was read) and ``dump`` (check or convert what is written)."""

    __slots__ = ("code", "dump", "load", "size")

    def __init__(self, code: str, *, load: Load | None = None, dump: Dump | None = None) -> None:
        layout = struct.Struct("<" + code)
        self.code, self.size, self.load, self.dump = code, layout.size, load, dump
        size, pack, unpack = layout.size, layout.pack, layout.unpack_from

        def read(r: BoundedReader, what: str) -> T:
            at = r.need(size, what)
            value: T = unpack(r.buf, at)[0]
            return value if load is None else load(r, value, what, at)

        def write(out: list[Buffer], value: T, what: str) -> None:
            out.append(pack(value if dump is None else dump(value, what)))

        self.read, self.write = read, write


class Variable(Wire[T]):
    """A variable-width field given by its two halves."""

    __slots__ = ()

    def __init__(
        self, read: Callable[[Any, str], T], write: Callable[[list[Buffer], T, str], None]
    ) -> None:
        self.read, self.write = read, write


def lenient(enum: type[E]) -> Load:
    """A load that gives the ``enum`` member for a known value and the plain int for any
    other (an error code or opcode a newer peer may send)."""
    known = frozenset(int(member) for member in enum)

    def load(r: BoundedReader, raw: int, what: str, at: int) -> int:
        return enum(raw) if raw in known else raw

    return load


U8: TypeAlias = Annotated[int, Fixed("B")]
U16: TypeAlias = Annotated[int, Fixed("H")]
U32: TypeAlias = Annotated[int, Fixed("I")]
U64: TypeAlias = Annotated[int, Fixed("Q")]
I64: TypeAlias = Annotated[int, Fixed("q")]


# --- compiling -------------------------------------------------------------------------


def _run(fields: Sequence[tuple[str, Fixed[Any]]]) -> tuple[_Writer, _Reader, int]:
    """Writer and reader of consecutive fixed-width fields: one struct for all."""
    layout = struct.Struct("<" + "".join(wire.code for _, wire in fields))
    pack, unpack, size = layout.pack, layout.unpack_from, layout.size
    get = attrgetter(*(name for name, _ in fields))
    dumps = [(i, name, wire.dump) for i, (name, wire) in enumerate(fields) if wire.dump]
    offsets = [sum(wire.size for _, wire in fields[:i]) for i in range(len(fields))]
    loads = [(i, name, wire.load, offsets[i]) for i, (name, wire) in enumerate(fields) if wire.load]
    singles = [(name, wire.read) for name, wire in fields]

    def write_one(message: object, out: list[Buffer]) -> None:
        out.append(pack(get(message)))

    def write_many(message: object, out: list[Buffer]) -> None:
        out.append(pack(*get(message)))

    def write_checked(message: object, out: list[Buffer]) -> None:
        values = [get(message)] if len(fields) == 1 else list(get(message))
        for i, name, dump in dumps:
            values[i] = dump(values[i], name)
        out.append(pack(*values))

    def read(r: BoundedReader) -> tuple[Any, ...]:
        pos = r.pos
        if size > r.end - pos:
            # Too short: field by field, so the error names the first that does not fit
            # (after the checks of those before it), as a reader of single fields would.
            return tuple(single(r, name) for name, single in singles)
        r.pos = pos + size
        if not loads:
            return unpack(r.buf, pos)
        values = list(unpack(r.buf, pos))
        for i, name, load, offset in loads:
            values[i] = load(r, values[i], name, pos + offset)
        return tuple(values)

    write = write_checked if dumps else write_one if len(fields) == 1 else write_many
    return write, read, size


def _field(name: str, wire: Wire[Any]) -> tuple[_Writer, _Reader]:
    """Writer and reader of one variable-width field."""
    wire_write, wire_read = wire.write, wire.read

    def write(message: object, out: list[Buffer]) -> None:
        wire_write(out, getattr(message, name), name)

    def read(r: BoundedReader) -> tuple[Any, ...]:
        return (wire_read(r, name),)

    return write, read


class Layout:
    """The wire form of a declared class, compiled from its fields' wires:
    ``write(message, out)`` appends its bytes, ``read(cls, reader)`` builds a ``cls``
    from the field values read in order."""

    __slots__ = ("min_size", "read", "write")

    def __init__(self, fields: Sequence[tuple[str, Wire[Any]]]) -> None:
        writers: list[_Writer] = []
        readers: list[_Reader] = []
        self.min_size = 0
        """Bytes of the fixed-width fields: the least any payload of the class takes."""
        run: list[tuple[str, Fixed[Any]]] = []
        for i, (name, wire) in enumerate(fields):
            if isinstance(wire, Fixed):
                run.append((name, wire))
                if i + 1 < len(fields) and isinstance(fields[i + 1][1], Fixed):
                    continue
                write, read, size = _run(run)
                self.min_size += size
                run = []
            else:
                write, read = _field(name, wire)
            writers.append(write)
            readers.append(read)
        self.write = _sequence(writers)
        self.read = _construct(readers)

    @classmethod
    def of(cls, owner: type) -> Layout | None:
        """The layout of ``owner``'s fields (annotations in order, ClassVars left out), or
        None when one of them declares no wire."""
        fields = []
        for name, hint in get_type_hints(owner, include_extras=True).items():
            if getattr(hint, "__origin__", None) is ClassVar:
                continue
            wires = [w for w in getattr(hint, "__metadata__", ()) if isinstance(w, Wire)]
            if not wires:
                return None
            fields.append((name, wires[0]))
        return cls(fields)


def _sequence(writers: Sequence[_Writer]) -> _Writer:
    if len(writers) == 1:
        return writers[0]
    if len(writers) == 2:
        first, second = writers

        def write_two(message: object, out: list[Buffer]) -> None:
            first(message, out)
            second(message, out)

        return write_two

    def write(message: object, out: list[Buffer]) -> None:
        for part in writers:
            part(message, out)

    return write


def _construct(readers: Sequence[_Reader]) -> Callable[[type[D], BoundedReader], D]:
    # One or two steps (most messages) without a loop: this is every decode's hot path.
    if len(readers) == 1:
        (only,) = readers

        def read_one(cls: type[D], r: BoundedReader) -> D:
            return cls(*only(r))

        return read_one
    if len(readers) == 2:
        first, second = readers

        def read_two(cls: type[D], r: BoundedReader) -> D:
            return cls(*first(r), *second(r))

        return read_two

    def read(cls: type[D], r: BoundedReader) -> D:
        values: list[Any] = []
        for part in readers:
            values += part(r)
        return cls(*values)

    return read


# --- declared classes ------------------------------------------------------------------


class Declared:
    """Base of a message (or record) dataclass whose fields declare their wires."""

    __slots__ = ()

    layout: ClassVar[Layout | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        layout = cls.layout = Layout.of(cls)
        write, read = _custom(cls, "_write"), _custom(cls, "_read")
        if layout is None:
            if not (write and read):
                raise TypeError(f"{cls.__name__}: every field needs a wire, or the class a codec")
            return
        if not write:
            cls._write = _compiled(layout.write)  # type: ignore[method-assign, assignment]
        if not read:
            cls._read = _compiled(classmethod(layout.read))  # type: ignore[method-assign, assignment]

    def _write(self, out: list[Buffer]) -> None:
        """Append the payload's bytes to ``out``."""
        raise NotImplementedError

    @classmethod
    def _read(cls, r: BoundedReader) -> Self:
        """Read one payload of this class."""
        raise NotImplementedError


_COMPILED = "__compiled_from_layout__"


def _compiled(method: T) -> T:
    setattr(method, _COMPILED, True)
    return method


def _custom(cls: type, name: str) -> bool:
    """Whether a class between ``cls`` and Declared writes its own ``name``."""
    for klass in cls.__mro__:
        if klass is Declared:
            return False
        method = klass.__dict__.get(name)
        if method is not None:
            return not getattr(method, _COMPILED, False)
    return False


def _write_record(out: list[Buffer], value: Declared, what: str) -> None:
    value._write(out)


def record(cls: type[D]) -> Wire[D]:
    """A declared class nested as a field (e.g. a list's items): its fields in order."""
    return Variable(lambda r, what: cls._read(r), _write_record)
