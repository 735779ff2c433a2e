"""Configuration: one frozen, keyword-only dataclass, validated on construction, with presets
and a TOML/YAML loader that maps onto the same fields."""
from __future__ import annotations

import dataclasses
import enum
import fnmatch
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Optional

from .formats import ROW_FORMATS, Fmt


class Role(str, enum.Enum):
    """Tensor roles that can be switched on; optimizer state rows are named optim.<state>."""
    OUTPUT = "output"
    INPUT = "input"
    GRAD_OUTPUT = "grad_output"
    WEIGHT = "weight"      # parameters (role "weight" for .weight, the parameter name otherwise)
    GRAD = "grad"          # parameter gradients after accumulation
    OPTIM = "optim"        # optimizer state after optimizer.step()
    LOSS = "loss"


class Backend(str, enum.Enum):
    AUTO = "auto"          # Triton kernel on CUDA tensors, pure torch elsewhere
    TRITON = "triton"
    TORCH = "torch"


DEFAULT_ROLES = (Role.OUTPUT, Role.GRAD_OUTPUT, Role.WEIGHT, Role.GRAD, Role.OPTIM, Role.LOSS)
SINK_NAMES = ("jsonl", "console", "wandb", "tensorboard")


@dataclass(frozen=True, kw_only=True)
class Config:
    modules: tuple[str, ...] = ()
    """Glob patterns on qualified module names to watch. Empty: every leaf module that owns
    parameters."""
    module_types: tuple[Any, ...] = ()
    """Module classes (or class names) to watch, in addition to `modules`."""
    select: Optional[Callable[[str, Any], bool]] = None
    """Predicate (name, module) -> bool, in addition to `modules` and `module_types`."""
    exclude: tuple[str, ...] = ()
    """Glob patterns of module names never watched."""
    roles: tuple[Role, ...] = DEFAULT_ROLES
    """Which tensors to read. Role.INPUT is off by default (it costs a read per module)."""
    every: int = 10
    """Statistics cadence: sample steps where step % every == 0 (the loss is read every step)."""
    warmup: int = 10
    """Steps 0..warmup-1 are all sampled, whatever `every` says."""
    role_every: Mapping[str, int] = field(default_factory=dict)
    """Per-role cadence overriding `every`, e.g. {"optim": 100}."""
    shadow_every: int = 0
    """Higher-precision shadow replicas every N sampled steps (0 = off). Not built yet: a
    non-zero value is accepted and reported as unsupported once."""
    formats: Mapping[str, str] = field(default_factory=dict)
    """Which format each tensor role would be cast to, as {role glob: format}, e.g.
    {"output": "e4m3", "weight": "e4m3", "grad*": "e5m2"}. Drives the overflow/underflow
    detectors. Formats with per-row counts: e4m3, e5m2, fp16."""
    scales: Mapping[str, float] = field(default_factory=dict)
    """Scale applied before the format check per role glob (|x*scale| vs the format's range)."""
    overflow_warn: float = 0.0
    """Warning when the fraction of finite values above the format's max exceeds this."""
    overflow_critical: float = 1e-3
    underflow_warn: float = 0.2
    """Warning when the fraction of nonzero finite values that round to zero exceeds this."""
    underflow_critical: float = 0.9
    min_numel: int = 64
    """Overflow/underflow fractions of tensors smaller than this are not judged (noise)."""
    alert_cooldown: int = 50
    """Steps before the same (detector, module, tensor, stat) may alert again at the same
    severity (a higher severity always goes through)."""
    sinks: tuple[str, ...] = ("jsonl", "console")
    """Any of: jsonl, console, wandb, tensorboard."""
    wandb_project: str = "stabilitywatch"
    wandb_stats: tuple[str, ...] = ()
    """Statistic names sent to W&B and TensorBoard (empty: the sinks' default list)."""
    queue_size: int = 1024
    """Bounded queue in front of the sinks (records are dropped, never waited for, when full)."""
    backend: Backend = Backend.AUTO
    rank: Optional[int] = None
    """Rank for records; None: torch.distributed's rank when initialised, else 0."""

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        for name in ("modules", "exclude", "sinks", "wandb_stats", "module_types"):
            v = getattr(self, name)
            set_(name, tuple(v) if isinstance(v, (tuple, list)) else (v,))
        for t in self.module_types:
            if not isinstance(t, (str, type)):
                raise ValueError(f"Config.module_types must hold classes or class names, got {t!r}")
        for name in ("modules", "exclude", "sinks", "wandb_stats"):
            for item in getattr(self, name):
                if not isinstance(item, str):
                    raise ValueError(f"Config.{name} must hold strings, got {item!r}")
        if self.select is not None and not callable(self.select):
            raise ValueError("Config.select must be a callable (name, module) -> bool")
        set_("roles", tuple(_enum(Role, r, "roles") for r in _seq(self.roles, "roles")))
        set_("backend", _enum(Backend, self.backend, "backend"))
        for name in ("every", "queue_size"):
            _int(getattr(self, name), f"Config.{name}", minimum=1)
        for name in ("warmup", "shadow_every", "alert_cooldown", "min_numel"):
            _int(getattr(self, name), f"Config.{name}", minimum=0)
        if self.rank is not None:
            _int(self.rank, "Config.rank", minimum=0)
        role_every = dict(_mapping(self.role_every, "role_every"))
        for k, v in role_every.items():
            _enum(Role, k, "role_every key")
            _int(v, f"Config.role_every[{k!r}]", minimum=1)
        set_("role_every", role_every)
        fmts = dict(_mapping(self.formats, "formats"))
        for k, v in fmts.items():
            _glob_key(k, "formats")
            # Fmt is a str-mixin enum: str(Fmt.E4M3) is "Fmt.E4M3", so unwrap it first
            name = v.value if isinstance(v, enum.Enum) else v
            if not isinstance(name, str) or name.lower() not in {f.value for f in ROW_FORMATS}:
                names = ", ".join(f.value for f in ROW_FORMATS)
                raise ValueError(f"Config.formats[{k!r}] = {v!r}: expected one of {names}")
            fmts[k] = Fmt(name.lower()).value
        set_("formats", fmts)
        scales = dict(_mapping(self.scales, "scales"))
        for k, v in scales.items():
            _glob_key(k, "scales")
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0
                    or not math.isfinite(v)):
                raise ValueError(f"Config.scales[{k!r}] must be a finite positive number, "
                                 f"got {v!r}")
            scales[k] = float(v)
        set_("scales", scales)
        for name in ("overflow_warn", "overflow_critical", "underflow_warn", "underflow_critical"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ValueError(f"Config.{name} must be a fraction in [0, 1], got {v!r}")
        for kind in ("overflow", "underflow"):
            warn, crit = getattr(self, f"{kind}_warn"), getattr(self, f"{kind}_critical")
            if warn > crit:
                raise ValueError(f"Config.{kind}_warn ({warn!r}) must not exceed "
                                 f"Config.{kind}_critical ({crit!r})")
        if not isinstance(self.wandb_project, str) or not self.wandb_project:
            raise ValueError(f"Config.wandb_project must be a non-empty string, "
                             f"got {self.wandb_project!r}")
        for s in self.sinks:
            if s not in SINK_NAMES:
                raise ValueError(f"Config.sinks: unknown sink {s!r}; expected any of {SINK_NAMES}")

    # -- presets and files ------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "Config":
        """Named presets: default, full, bf16, fp16, fp8, debug."""
        if not isinstance(name, str) or name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
        _check_known(cls, overrides)
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Config":
        if not isinstance(data, Mapping):
            raise ValueError(f"Config.from_dict expects a mapping, got {type(data).__name__}")
        data = dict(data)
        base = data.pop("preset", None)
        _check_known(cls, data)
        return cls.preset(base, **data) if base is not None else cls(**data)

    @classmethod
    def from_file(cls, path: "str | os.PathLike") -> "Config":
        """Load a .toml, .yaml/.yml or .json file (optionally with `preset = "..."`)."""
        path = os.fspath(path)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise ValueError(f"cannot read config file {path!r}: {e.strerror}") from None
        data = _parse(path, raw)
        if not isinstance(data, dict):
            raise ValueError(f"config file {path!r} must hold a table/mapping at the top")
        data = data.get("stabilitywatch", data)
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"config file {path!r}: {e}") from None

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)

    # -- lookups used by the monitor ---------------------------------------------------------
    def format_for(self, role: str) -> Optional[str]:
        return _glob_lookup(self.formats, role)

    def scale_for(self, role: str) -> float:
        v = _glob_lookup(self.scales, role)
        return 1.0 if v is None else float(v)

    def role_enabled(self, role: Role) -> bool:
        return role in self.roles


def _glob_lookup(table: Mapping[str, Any], role: str):
    if role in table:
        return table[role]
    for pat, v in table.items():
        if fnmatch.fnmatchcase(role, pat):
            return v
    return None


def _check_known(cls, data: Mapping) -> None:
    known = {f.name for f in fields(cls)}
    unknown = sorted((str(k) for k in data if k not in known))
    if unknown:
        raise ValueError(f"unknown Config field(s): {', '.join(unknown)}; "
                         f"expected any of {', '.join(sorted(known))}")


def _glob_key(k, name):
    if not isinstance(k, str):
        raise ValueError(f"Config.{name} keys must be role names or globs (strings), got {k!r}")


def _seq(v, name):
    if isinstance(v, (str, enum.Enum)):
        return (v,)
    if not isinstance(v, (tuple, list)):
        raise ValueError(f"Config.{name} must be a list, got {v!r}")
    return v


def _enum(kind, v, name):
    try:
        return kind(v.value if isinstance(v, enum.Enum) else v)
    except ValueError:
        raise ValueError(f"Config.{name}: {v!r} is not one of "
                         f"{[m.value for m in kind]}") from None


def _int(v, name, minimum):
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")


def _mapping(v, name):
    if not isinstance(v, Mapping):
        raise ValueError(f"Config.{name} must be a mapping, got {v!r}")
    return v


def _parse(path: str, raw: bytes):
    low = path.lower()
    try:
        if low.endswith(".toml"):
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            return tomllib.loads(raw.decode())
        if low.endswith((".yaml", ".yml")):
            try:
                import yaml
            except ModuleNotFoundError:
                raise ValueError("YAML config needs pyyaml: pip install stabilitywatch[yaml]") from None
            return yaml.safe_load(raw.decode())
        if low.endswith(".json"):
            import json
            return json.loads(raw.decode())
    except ValueError as e:
        if "pyyaml" in str(e):
            raise
        raise ValueError(f"cannot parse config file {path!r}: {e}") from None
    except Exception as e:  # yaml.YAMLError and friends
        raise ValueError(f"cannot parse config file {path!r}: {e}") from None
    raise ValueError(f"config file {path!r}: expected a .toml, .yaml, .yml or .json file")


_FP8_FORMATS = {"output": "e4m3", "input": "e4m3", "weight": "e4m3",
                "grad_output": "e5m2", "grad": "e5m2"}
PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    # every tensor role, every step: debugging a known-bad run
    "full": {"every": 1, "roles": tuple(Role)},
    "bf16": {},
    "fp16": {"formats": {"output": "fp16", "input": "fp16", "weight": "fp16",
                         "grad_output": "fp16", "grad": "fp16"}},
    "fp8": {"formats": _FP8_FORMATS},
    "debug": {"every": 1, "roles": tuple(Role), "alert_cooldown": 1},
}
