"""Building blocks of the nested Config: an immutable mapping that hashes, the checks the
sub-configs share, and "did you mean" for unknown names.

It imports nothing from the package (config.py and the sub-config modules import it)."""
from __future__ import annotations

import dataclasses
import difflib
import enum
import math
from typing import Any, Iterable, Iterator, Mapping


class UnknownFieldError(TypeError, ValueError):
    """A name Config does not know (a ValueError, and a TypeError like any unknown keyword)."""


class FrozenMap(Mapping):
    """A read-only mapping that hashes, so that a Config holding one hashes too; it compares
    equal to a dict with the same items."""
    __slots__ = ("_d", "_h")

    def __init__(self, items: Any = ()) -> None:
        object.__setattr__(self, "_d", dict(items))
        object.__setattr__(self, "_h", None)

    def __getitem__(self, k):
        return self._d[k]

    def __iter__(self) -> Iterator:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __hash__(self) -> int:
        if self._h is None:
            object.__setattr__(self, "_h", hash(frozenset(self._d.items())))
        return self._h

    def __setattr__(self, k, v):
        raise AttributeError("FrozenMap is read-only")

    def __repr__(self) -> str:
        return repr(self._d)

    def __reduce__(self):
        return (FrozenMap, (self._d,))


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """'; did you mean 'x'?' for the closest choice, or ''."""
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def build(cls, data: Mapping[str, Any], where: str, base: Any = None):
    """A sub-config from a mapping (a table of a config file, a dict passed to Config): keys
    update `base` (the defaults when None); an unknown key raises ValueError naming it."""
    if not isinstance(data, Mapping):
        raise ValueError(f"Config.{where} must be a {cls.__name__} or a mapping of its fields, "
                         f"got {data!r}")
    known = field_names(cls)
    for k in data:
        if k not in known:
            close = difflib.get_close_matches(str(k), known, n=1)
            hint = f"; did you mean '{where}.{close[0]}'?" if close else ""
            raise UnknownFieldError(f"unknown field '{where}.{k}'{hint} ({cls.__name__} has: "
                                    f"{', '.join(known)})")
    if base is None:
        return cls(**data)
    return dataclasses.replace(base, **data)


# -- checks shared by the sub-configs: each raises ValueError naming `name` ------------------
def check_int(v: Any, name: str, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"Config.{name} must be an integer >= {minimum}, got {v!r}")
    return v


def check_number(v: Any, name: str, lo: float, hi: float | None = None, strict: bool = False,
                 may_be_inf: bool = False, what: str = "a finite number") -> float:
    ok = (not isinstance(v, bool) and isinstance(v, (int, float))
          and (math.isfinite(v) or (may_be_inf and v == math.inf)))
    ok = ok and (v > lo if strict else v >= lo) and (hi is None or v <= hi)
    if not ok:
        rng = f"{'>' if strict else '>='} {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")
        raise ValueError(f"Config.{name} must be {what} {rng}, got {v!r}")
    return float(v)


def check_bool(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"Config.{name} must be True or False, got {v!r}")
    return v


def check_enum(kind, v: Any, name: str):
    try:
        return kind(v.value if isinstance(v, enum.Enum) else v)
    except ValueError:
        values = [m.value for m in kind]
        raise ValueError(f"Config.{name}: {v!r} is not one of {values}"
                         f"{did_you_mean(getattr(v, 'value', v), values)}") from None


def check_strings(v: Any, name: str) -> tuple[str, ...]:
    """A tuple of strings from a string, list or tuple."""
    items = (v,) if isinstance(v, str) else v
    if not isinstance(items, (tuple, list)):
        raise ValueError(f"Config.{name} must be a list of strings, got {v!r}")
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"Config.{name} must hold strings, got {item!r}")
    return tuple(items)


def check_choices(values: tuple[str, ...], choices: tuple[str, ...], name: str,
                  what: str = "") -> None:
    for v in values:
        if v not in choices:
            raise ValueError(f"Config.{name}: {v!r} is not one of {choices}"
                             f"{did_you_mean(v, choices)}{what}")


def not_above(small: float, big: float, small_name: str, big_name: str) -> None:
    if small > big:
        raise ValueError(f"Config.{small_name} ({small!r}) must not exceed "
                         f"Config.{big_name} ({big!r})")
