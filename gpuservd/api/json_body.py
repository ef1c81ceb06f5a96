"""Request bodies as JSON, parsed with limits a client cannot push past.

Python's json module accepts what a hostile client can turn into a 500 or a
stall further down: nesting deep enough to exhaust the recursion limit,
integers of thousands of digits (int() refuses them past 4300 digits, and
smaller ones still reach arithmetic), lone UTF-16 surrogates that no encoder
(the tokenizer's included) will take, and the non-standard NaN/Infinity
literals. Every one of these is a 400 here, naming where it was found, before
any field is read. No torch, no I/O: the client and the CLI import this too.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 32  # arrays/objects inside each other; chat bodies need 4, tool schemas a dozen at most
MAX_INT_DIGITS = 40  # an int64 has 19 digits, a uint64 20; anything much longer is not a real value


class BodyError(ValueError):
    """The body is not JSON we accept; `param` names the field when one is to blame."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _NotJSON:
    """What json gives for NaN / Infinity / -Infinity here: refused by _walk, which knows the field."""

    def __init__(self, name: str):
        self.name = name


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise BodyError(f"the request body holds an integer of {digits} digits; at most {MAX_INT_DIGITS}")
    return int(text)


def _parse_float(text: str) -> float:
    if len(text) > 400:  # float() is linear, but there is no real value this long either
        raise BodyError(f"the request body holds a number of {len(text)} characters")
    return float(text)


def _path(entry) -> str | None:
    """The field path of a _walk entry (value, depth, parent entry, key), e.g. messages[0].content."""
    keys = []
    while entry is not None and entry[2] is not None:
        keys.append(entry[3])
        entry = entry[2]
    out = ""
    for p in reversed(keys):
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def _check_string(s: str, entry) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = _path(entry)
        raise BodyError(f"{where or 'the request body'} holds a lone surrogate (\\u{ord(s[exc.start]):04x}) at "
                        f"character {exc.start}; send valid UTF-16 pairs or UTF-8", where) from None


_SCALARS = frozenset((int, float, bool, type(None)))  # nothing to check in these (NaN/Infinity: _NotJSON)


def _walk(value: Any) -> None:
    """Depth and string checks without recursion (the value may be as deep as json allowed).

    It runs on the event loop for every body, and a body may be a list of a million numbers (a prompt
    of token ids), so scalars are skipped where they are met and a field's path is worked out only for
    the error message, from parent links rather than a list copied per item.
    """
    stack = [(value, 0, None, None)]
    while stack:
        entry = stack.pop()
        v, depth = entry[0], entry[1]
        if isinstance(v, str):
            _check_string(v, entry)
        elif isinstance(v, _NotJSON):
            where = _path(entry)
            raise BodyError(f"{where or 'the request body'} is {v.name}, which is not JSON; send a finite number",
                            where)
        elif isinstance(v, (dict, list)):
            if depth >= MAX_DEPTH:
                where = _path(entry)
                raise BodyError(f"the request body nests arrays/objects deeper than {MAX_DEPTH} levels"
                                + (f" (at {where})" if where else ""), where)
            if isinstance(v, list) and not set(map(type, v)) - _SCALARS:
                continue  # numbers only (token ids, say): one pass in C instead of one Python step each
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, item in items:
                if isinstance(k, str):
                    _check_string(k, entry)
                if type(item) not in _SCALARS:
                    stack.append((item, depth + 1, entry, k))


# A number the hooks below must see has a run of more digits than MAX_INT_DIGITS: an integer that
# long, or a float of over 400 characters (at most three digit runs). Bodies without one (nearly all)
# are parsed without a Python call per number.
_LONG_DIGITS = re.compile(rb"[0-9]{%d}" % (MAX_INT_DIGITS + 1))


def loads(raw: bytes) -> Any:
    """Parse a request body; BodyError says what is wrong and where."""
    try:
        if _LONG_DIGITS.search(raw) is None:
            value = json.loads(raw, parse_constant=_NotJSON)
        else:
            value = json.loads(raw, parse_constant=_NotJSON, parse_int=_parse_int, parse_float=_parse_float)
    except BodyError:
        raise
    except RecursionError:
        raise BodyError(f"the request body nests arrays/objects deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError as exc:
        raise BodyError(f"the request body is not valid JSON at line {exc.lineno} column {exc.colno}: "
                        f"{exc.msg}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise BodyError(f"the request body is not valid JSON: {str(exc).splitlines()[0][:200]}") from None
    _walk(value)
    return value
