"""What the dashboards (W&B, TensorBoard) show: the metric budget, the key names, histograms and
the run's config, shared by both sinks so they show the same keys.

Keys are `sw.<role>.<stat>/<module>` (module "" is `model`): W&B's automatic panel sections and
TensorBoard's tag groups both split at the first '/', so each (role, statistic) gets a section
of its own, one panel per module, instead of one section holding every panel.
"""
from __future__ import annotations

import dataclasses
import enum
import fnmatch
import math
import sys
from typing import Any, Iterable, Mapping, Optional

import numpy as np

from ..config_dashboards import DEFAULT
from ..stats.derive import DerivedRow
from ..stats.layout import HIST_EMIN

PREFIX = "sw"
STEP_KEY = f"{PREFIX}/step"
HIST_STAT = "exponents"

# Rows the default set leaves out: biases (a second copy of every role of a layer) and the raw
# rows a shadow replica records (its error measures have role `shadow`).
DEFAULT_SKIP_ROLES = ("bias", "*.bias", "shadow.*")
# The statistics the default set shows, by role glob (first match); every other role gets
# _VALUE_STATS plus the overflow and underflow fractions of its configured format.
_ROLE_STATS = (("loss", ("mean", "nonfinite")), ("grad_norm", ("l2norm",)),
               ("shadow", ("rel_l2",)), ("shadow.model", ("rel_l2",)))
_VALUE_STATS = ("absmax", "rms", "nonfinite")
_WHOLE_MODEL = ("loss", "grad_norm")


def metric_key(role: str, stat: str, module: str) -> str:
    return f"{PREFIX}.{role}.{stat}/{module or 'model'}"


class Dashboard:
    """The keys of one record: a fixed small set per (module, role) by default, more on request.

    `stats` entries (Config.sinks.dashboard_stats): "default" (the set above), a statistic name or
    glob ("mean", "e5m2_*") added for every role the default set shows, or "ROLE:STAT" globs
    ("grad*:std", "*bias:absmax", "shadow.*:*") that also reach roles the default leaves out.
    """

    def __init__(self, stats: Iterable[str] = (DEFAULT,), formats: Optional[Mapping] = None,
                 histograms: bool = True):
        self.entries = tuple(stats)
        self.formats = dict(formats or {})
        self.histograms = bool(histograms)
        self._by_role: dict[tuple, tuple[str, ...]] = {}
        self._names: dict[tuple, list[str]] = {}
        self._hist_roles: dict[str, bool] = {}

    @classmethod
    def from_config(cls, config) -> "Dashboard":
        stats = config.sinks.dashboard_stats
        return cls(stats, config.formats, config.sinks.dashboard_histograms)

    def stats_for(self, role: str, available: Iterable[str]) -> tuple[str, ...]:
        """The statistics shown for this role (those of `available` the entries select)."""
        # a frame's rows (DerivedRow) all carry the same names: one lookup per role
        key = (role, None) if isinstance(available, DerivedRow) else (role, tuple(available))
        got = self._by_role.get(key)
        if got is None:
            got = self._by_role[key] = self._select(role, tuple(available))
        return got

    def _select(self, role: str, available: tuple[str, ...]) -> tuple[str, ...]:
        names = (set(available) | {"nonfinite"}) if "nan" in available else set(available)
        shown = not any(fnmatch.fnmatchcase(role, p) for p in DEFAULT_SKIP_ROLES)
        out: list[str] = []
        for entry in self.entries:
            if entry == DEFAULT:
                picked = _default_stats(role, self._format(role)) if shown else ()
            elif ":" in entry:
                rpat, spat = entry.split(":", 1)
                picked = (sorted(n for n in names if fnmatch.fnmatchcase(n, spat))
                          if fnmatch.fnmatchcase(role, rpat) else ())
            else:
                picked = sorted(n for n in names if fnmatch.fnmatchcase(n, entry)) if shown else ()
            out += [n for n in picked if n in names and n not in out]
        return tuple(out)

    def _format(self, role: str) -> Optional[str]:
        if role in self.formats:
            return self.formats[role]
        for pat, fmt in self.formats.items():
            if fnmatch.fnmatchcase(role, pat):
                return fmt
        return None

    def wants_histogram(self, module: str, role: str) -> bool:
        if not (self.histograms and module):
            return False
        got = self._hist_roles.get(role)
        if got is None:
            got = self._hist_roles[role] = (
                role not in _WHOLE_MODEL and not role.startswith("shadow")
                and not any(fnmatch.fnmatchcase(role, p) for p in DEFAULT_SKIP_ROLES))
        return got

    def values(self, record: Mapping[str, Any]) -> tuple[list[str], list[float]]:
        """(keys, values) this record puts on the dashboards."""
        stats = record.get("stats") or {}
        module, role = record["module"], record["tensor"]
        chosen = self.stats_for(role, stats)
        names = self._names.get((module, role, chosen))
        if names is None:
            names = self._names[(module, role, chosen)] = [metric_key(role, s, module)
                                                           for s in chosen]
        if isinstance(stats, DerivedRow):   # read the frame's columns directly: ~2x faster
            cols, i = stats.table, stats.index
            get = lambda k: cols[k][i]  # noqa: E731
        else:
            get = stats.__getitem__
        vals = [float(get("nan")) + float(get("posinf")) + float(get("neginf"))
                if s == "nonfinite" else float(get(s)) for s in chosen]
        return names, vals

    def histogram(self, record: Mapping[str, Any]) -> Optional[tuple[str, int, np.ndarray]]:
        """(key, first exponent, counts) of the record's exponent histogram, trimmed to its
        nonzero bins: counts[i] values with floor(log2|x|) == first + i (the end bins of the
        row's range are open). None when there is none."""
        if not self.wants_histogram(record["module"], record["tensor"]):
            return None
        hist = getattr(record.get("stats"), "hist", None)
        if hist is None:
            return None
        nz = np.flatnonzero(hist)
        if nz.size == 0:
            return None
        lo, hi = int(nz[0]), int(nz[-1]) + 1
        return (metric_key(record["tensor"], HIST_STAT, record["module"]), HIST_EMIN + lo,
                np.array(hist[lo:hi], dtype=np.float64))

    def keys_of(self, records: Iterable[Mapping[str, Any]]) -> list[str]:
        """Every key one step's records put on the dashboards (its histograms included, the
        step key not): what a sampled step costs."""
        out = []
        for r in records:
            out += self.values(r)[0]
            h = self.histogram(r)
            if h is not None:
                out.append(h[0])
        return out


def _default_stats(role: str, fmt: Optional[str]) -> tuple[str, ...]:
    for pat, stats in _ROLE_STATS:
        if role == pat:
            return stats
    if role.startswith("shadow"):
        return ()
    extra = (f"{fmt}_overflow_frac", f"{fmt}_underflow_frac") if fmt else ()
    return _VALUE_STATS + extra


def hist_edges(first: int, n: int) -> np.ndarray:
    """Bin edges, in log2 units, of n exponent bins starting at `first`."""
    return np.arange(first, first + n + 1, dtype=np.float64)



def run_config(config, rank: int, world_size: int) -> dict[str, Any]:
    """The monitor's Config as plain JSON values, with the versions, rank and world size."""
    from .. import __version__
    out: dict[str, Any] = {}
    if config is not None:
        for f in dataclasses.fields(config):
            out[f.name] = _plain(getattr(config, f.name))
    torch = sys.modules.get("torch")
    out["versions"] = {"stabilitywatch": __version__,
                       "torch": getattr(torch, "__version__", None),
                       "python": sys.version.split()[0]}
    out["rank"], out["world_size"] = int(rank), int(world_size)
    return out


def _plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, enum.Enum):
        return _plain(v.value)
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (tuple, list, set, frozenset)):
        return [_plain(x) for x in v]
    if isinstance(v, type):
        return f"{v.__module__}.{v.__qualname__}"
    if callable(v):
        return f"{getattr(v, '__module__', '?')}.{getattr(v, '__qualname__', repr(v))}"
    return repr(v)


def flat_config(cfg: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config as flat `a.b` keys of numbers, bools or strings (TensorBoard hparams)."""
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flat_config(v, key + "."))
        elif isinstance(v, (bool, int, float, str)):
            out[key] = v
        elif v is not None:
            out[key] = str(v)
    return out
