"""How an event dataclass becomes JSON and back (types.py declares the events themselves).

Declared fields are written by name (or the `json` key in their metadata, for a
name Python reserves), a field made with `optional()` is left out while it is
None, and a key a reader does not know is kept in `extra` and written back
unchanged. A field's `parse` metadata reads its nested parts.
"""

from __future__ import annotations

from dataclasses import field, fields
from typing import Any, ClassVar


def optional(default: Any = None, **meta) -> Any:
    """A field left out of the JSON while it is None (it exists only for some phases or daemons)."""
    return field(default=default, metadata={"optional": True, **meta})


def to_plain(value: Any) -> Any:
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    return value


class JsonShape:
    """JSON to and from a dataclass: declared fields by name (or their `json` key), the rest in `extra`."""

    _compat: ClassVar[tuple[str, ...]] = ()  # keys written for schema-1 readers and derived again on reading

    def _fields_json(self) -> dict:
        out: dict = {}
        for f in fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if value is None and f.metadata.get("optional"):
                continue
            out[f.metadata.get("json", f.name)] = to_plain(value)
        return out

    @classmethod
    def _from_fields(cls, data: dict):
        kwargs: dict = {}
        known = set(cls._compat) | {"type"}
        for f in fields(cls):
            if f.name == "extra":
                continue
            key = f.metadata.get("json", f.name)
            known.add(key)
            if key in data:
                value = data[key]
                parse = f.metadata.get("parse")
                kwargs[f.name] = parse(value) if parse is not None and value is not None else value
        extra = {k: v for k, v in data.items() if k not in known}
        if any(f.name == "extra" for f in fields(cls)):
            kwargs["extra"] = extra
        return cls(**kwargs)


def parse_list(item_cls):
    return lambda values: [item_cls.from_json(v) if isinstance(v, dict) else v for v in values]


def upgrade(item_cls):
    """Parts a step record keeps in their JSON form: read (either schema) and written back as schema 2."""
    return lambda values: [item_cls.from_json(v).to_json() if isinstance(v, dict) else v.to_json() for v in values]
