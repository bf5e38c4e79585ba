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
its layout (straight-line code over the precompiled structs: as fast as the hand-written
pairs they replace). A message whose wire form is not a plain sequence of its fields (bit
flags, constants, optional sections) overrides them, and then its fields need no wire.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from enum import IntEnum
from itertools import groupby
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
#
# A layout's writer and reader are generated as straight-line Python, as dataclasses
# generates __init__: one pack per run of fixed fields, one call per variable field, no
# loop and no per-field dispatch, so a declared message costs what the hand-written
# encoder and decoder it replaces cost (these are every payload's hot path).


def _short(fields: Sequence[tuple[str, Fixed[Any]]]) -> Callable[[BoundedReader], None]:
    """For a run too short to unpack: read its fields one at a time, which raises naming
    the first that does not fit (after the checks of those before it), as a reader of
    single fields would."""

    def read(r: BoundedReader) -> None:
        for name, wire in fields:
            wire.read(r, name)
        raise AssertionError("a short run of fields read whole")

    return read


class Layout:
    """The wire form of a declared class, compiled from its fields' wires:
    ``write(message, out)`` appends its bytes, ``read(cls, reader)`` builds a ``cls``
    from the field values read in order."""

    __slots__ = ("min_size", "read", "write")

    def __init__(self, fields: Sequence[tuple[str, Wire[Any]]]) -> None:
        env: dict[str, Any] = {}  # what the generated code calls, by generated name
        write = ["def write(self, out):"]
        read = ["def read(cls, r):"]
        self.min_size = 0
        """Bytes of the fixed-width fields: the least any payload of the class takes."""
        n = 0  # fields so far: field i is read into local v{i}
        for fixed, group in groupby(fields, key=lambda field: isinstance(field[1], Fixed)):
            if not fixed:
                for name, wire in group:
                    env[f"write{n}"], env[f"read{n}"] = wire.write, wire.read
                    write.append(f"    write{n}(out, self.{name}, {name!r})")
                    read.append(f"    v{n} = read{n}(r, {name!r})")
                    n += 1
                continue
            run: list[tuple[str, Fixed[Any]]] = list(group)  # type: ignore[arg-type]
            layout = struct.Struct("<" + "".join(wire.code for _, wire in run))
            self.min_size += layout.size
            env[f"pack{n}"], env[f"unpack{n}"] = layout.pack, layout.unpack_from
            env[f"short{n}"] = _short(run)
            local = [f"v{n + i}" for i in range(len(run))]
            read += [
                "    pos = r.pos",
                f"    if {layout.size} > r.end - pos:",
                f"        short{n}(r)",
                f"    r.pos = pos + {layout.size}",
                f"    {', '.join(local)}, = unpack{n}(r.buf, pos)",
            ]
            args, offset = [], 0
            for v, (name, wire) in zip(local, run, strict=True):
                if wire.dump is None:
                    args.append(f"self.{name}")
                else:
                    env[f"dump_{v}"] = wire.dump
                    args.append(f"dump_{v}(self.{name}, {name!r})")
                if wire.load is not None:
                    env[f"load_{v}"] = wire.load
                    read.append(f"    {v} = load_{v}(r, {v}, {name!r}, pos + {offset})")
                offset += wire.size
            write.append(f"    out.append(pack{n}({', '.join(args)}))")
            n += len(run)
        write.append("    pass")
        read.append(f"    return cls({', '.join(f'v{i}' for i in range(n))})")
        exec("\n".join(write) + "\n\n" + "\n".join(read), env)
        self.write: Callable[[Any, list[Buffer]], None] = env["write"]
        self.read: Callable[[Any, BoundedReader], Any] = env["read"]

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
