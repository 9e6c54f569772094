"""Reuse scopes: the namespace a cached prefix belongs to.

Caches under different scopes never share blocks, because each scope hashes to
its own root key (``hashing.root_key``). The byte layout of a scope is part of
the reference-compatible key and must not change (docs/semantics.md §1.2).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

_U64_MAX = 2**64 - 1


@dataclass(frozen=True)
class ReuseScope:
    """A reuse namespace: an optional LoRA adapter id and an optional cache salt.

    Both fields are unsigned 64-bit integers or None. Frozen, so it can key dicts.
    """

    lora_id: int | None = None
    salt: int | None = None

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            # bool is an int subclass, but True as a LoRA id is surely a mistake.
            if type(value) is bool or not isinstance(value, int):
                raise TypeError(
                    f"ReuseScope.{f.name} must be an int or None, got {type(value).__name__}"
                )
            if not 0 <= value <= _U64_MAX:
                raise ValueError(f"ReuseScope.{f.name} must be in 0..2**64-1, got {value}")

    def to_bytes(self) -> bytes:
        """One mask byte (bit i set when field i is present), then one
        little-endian u64 per present field, in field order.

        >>> ReuseScope().to_bytes()
        b'\\x00'
        >>> ReuseScope(salt=1).to_bytes().hex()
        '020100000000000000'
        """
        values = [getattr(self, f.name) for f in fields(self)]
        mask = sum(1 << i for i, v in enumerate(values) if v is not None)
        out = bytearray([mask])
        for v in values:
            if v is not None:
                out += int(v).to_bytes(8, "little")
        return bytes(out)


def as_scope(scope) -> ReuseScope:
    """``None`` -> the default scope; a ``ReuseScope`` as is; anything else is an error."""
    if scope is None:
        return ReuseScope()
    if isinstance(scope, ReuseScope):
        return scope
    raise TypeError(f"scope must be a gpukv.ReuseScope or None, got {type(scope).__name__}")
