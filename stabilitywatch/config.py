"""Configuration: a frozen, keyword-only dataclass of what to read and when, holding one frozen
sub-config per subsystem (drift, spike, shadow, range, update, incidents, capture, sinks, dist,
guard); validated on construction, hashable, with presets and a TOML/YAML/JSON loader that maps
nested tables onto the same dataclasses."""
from __future__ import annotations

import dataclasses
import enum
import fnmatch
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Optional

from .config_base import (FrozenMap, UnknownFieldError, build, check_bool, check_number,
                          check_strings, did_you_mean)
from .config_capture import CaptureConfig
from .config_detectors import DETECTOR_NAMES, DriftConfig, ShadowConfig, SpikeConfig
from .config_extensions import check_detector_entries
from .config_distributed import DistBackend, DistConfig, DistMode  # noqa: F401 (public)
from .config_flat import FLAT_NAMES, GROUPS, SHORTHAND, split_flat, suggest
from .config_incidents import IncidentConfig, RangeConfig, UpdateConfig
from .config_sentinel import GuardConfig
from .config_sinks import SINK_NAMES, SinkConfig  # noqa: F401 (SINK_NAMES: public)
from .formats import ROW_FORMATS, Fmt
from .stats.scale import FLT_MAX as _FLT_MAX, FLT_MIN as _FLT_MIN
from .config_processing import validate_processing_fields


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
SUBCONFIGS = {"drift": DriftConfig, "spike": SpikeConfig, "shadow": ShadowConfig,
              "range": RangeConfig, "update": UpdateConfig, "incidents": IncidentConfig,
              "capture": CaptureConfig, "sinks": SinkConfig, "dist": DistConfig,
              "guard": GuardConfig}
assert tuple(SUBCONFIGS) == GROUPS


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
    role_every: Mapping[str, int] = FrozenMap()
    """Per-role cadence overriding `every`, e.g. {"optim": 100}."""
    cost_budget: float = 0.01
    """The share of the step time the monitor may cost, measured on the run: where the every-step
    sentinel and the sampled steps together would cost more at `every`, the cadences (`every`,
    role_every) are stretched by the smallest whole factor that fits, at most 4. 0 = the cadences as given. Never stretched: `every=1`, escalation windows, the warm-up,
    and multi-rank runs (their ranks must sample the same steps). See stabilitywatch/pacing.py."""
    shadow_every: int = 0
    """Higher-precision shadow replicas on every N-th sampled step (0 = off): the modules of
    `shadow.modules` are re-run in `shadow.dtype` on the same inputs (see stabilitywatch/shadow)."""
    escalate_steps: int = 20
    """A tripped sentinel or a warning-or-worse alert switches the next this-many steps to full
    sampling (every role); 0 = off. Multi-rank runs escalate on the cross-rank sentinel flag."""
    sentinel: bool = True
    """Every step, before the optimizer step, read every watched parameter gradient once (one
    multi-tensor launch): its NaN/Inf count, largest finite |x| and sum of squares."""
    detectors: tuple[Any, ...] = ("drift", "spike", "shadow")
    """Extra detectors switched on: names, or your own stabilitywatch.Detector instances
    (nonfinite, overflow and underflow are always on)."""
    attn_logits: tuple[str, ...] = ()
    """Globs of modules whose output is attention logits (q.k/sqrt(d), before masking and
    softmax); also every `stabilitywatch.LogitsTap("attention")` in the model. Role `attn_logits`."""
    output_logits: tuple[str, ...] = ()
    """Globs of modules whose output is the model's output logits; also every
    `stabilitywatch.LogitsTap("output")`. Roles `logits` and `logz` (logsumexp over the last dim)."""
    # -- formats, backend and rank
    formats: Mapping[str, str] = FrozenMap()
    """Which format each tensor role would be cast to, as {role glob: format}, e.g.
    {"output": "e4m3", "weight": "e4m3", "grad*": "e5m2"}. Drives the overflow/underflow
    detectors. Formats with per-row counts: e4m3, e5m2, fp16."""
    scales: Mapping[str, float] = FrozenMap()
    """Scale applied before the format check per role glob (|x*scale| vs the format's range)."""
    backend: Backend = Backend.AUTO
    """"auto": the Triton kernel on CUDA tensors, pure torch elsewhere; "triton" (an error where
    Triton does not import); "torch": the pure-torch reference."""
    rank: Optional[int] = None
    """Rank for records; None: torch.distributed's rank when initialised, else 0."""
    # -- sub-configs: each a frozen dataclass, or a mapping of its fields (a config file's table)
    drift: DriftConfig = field(default_factory=DriftConfig)
    """The drift detector: change points and the time-to-overflow forecast (`DriftConfig`)."""
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    """The spike detector: loss, gradient norms, attention and output logits (`SpikeConfig`)."""
    shadow: ShadowConfig = field(default_factory=ShadowConfig)
    """Which modules get shadow replicas, their precision, the shadow detector (`ShadowConfig`)."""
    range: RangeConfig = field(default_factory=RangeConfig)
    """Overflow and underflow thresholds (`RangeConfig`)."""
    update: UpdateConfig = field(default_factory=UpdateConfig)
    """The optimizer-update ratio and the physics check of weights (`UpdateConfig`)."""
    incidents: IncidentConfig = field(default_factory=IncidentConfig)
    """Incident severities and the alert cooldown (`IncidentConfig`)."""
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    """Capture bundles and snapshots (`CaptureConfig`); a list is short for its `triggers`."""
    sinks: SinkConfig = field(default_factory=SinkConfig)
    """Sinks, their queues and timeouts, W&B and the dashboards (`SinkConfig`); a list is short
    for its `use`."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Multi-rank runs: who writes, how often ranks flush, divergence checks (`DistConfig`)."""
    guard: GuardConfig = field(default_factory=GuardConfig)
    """Skipping steps with non-finite gradients (`GuardConfig`)."""
    # -- frame processing (stabilitywatch/processing.py; README "Frame processing, off the
    # training thread"); checked in config_processing.py
    processing: str = "thread"
    """Where a step's frame is processed (detectors, incidents, capture decisions, records for the
    sinks): "thread" (a thread of the monitor's own; the step end only queues the frame) or
    "inline" (on the training thread at the step end: for debugging, or to read `mon.alerts`
    step by step)."""
    processing_lag: int = 1
    """With processing="thread": the step ends a frame's processing may trail. At the start of
    step k every frame read at the end of step k-1-lag or earlier is processed (the start
    waits for it otherwise), so an alert's escalation opens its window `lag` steps later than
    inline processing would."""
    processing_timeout: float = 10.0
    """Seconds one stage of a frame's processing (one detector, the capture decision...) may
    take; a stage that takes longer is switched off for the rest of the run (one warning naming
    it) and the frames go on without it."""

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        for name in ("modules", "exclude", "module_types"):
            v = getattr(self, name)
            set_(name, tuple(v) if isinstance(v, (tuple, list)) else (v,))
        for t in self.module_types:
            if not isinstance(t, (str, type)):
                raise ValueError(f"Config.module_types must hold classes or class names, got {t!r}")
        for name in ("modules", "exclude", "attn_logits", "output_logits"):
            set_(name, check_strings(getattr(self, name), name))
        v = self.detectors
        set_("detectors", tuple(v) if isinstance(v, (tuple, list)) else (v,))
        check_detector_entries(self.detectors, DETECTOR_NAMES)
        if self.select is not None and not callable(self.select):
            raise ValueError("Config.select must be a callable (name, module) -> bool")
        set_("roles", tuple(_enum(Role, r, "roles") for r in _seq(self.roles, "roles")))
        set_("backend", _enum(Backend, self.backend, "backend"))
        _int(self.every, "Config.every", minimum=1)
        set_("cost_budget", check_number(self.cost_budget, "cost_budget", 0.0, 1.0, strict=False,
                                         what="a fraction"))
        for name in ("warmup", "shadow_every", "escalate_steps"):
            _int(getattr(self, name), f"Config.{name}", minimum=0)
        if self.rank is not None:
            _int(self.rank, "Config.rank", minimum=0)
        check_bool(self.sentinel, "sentinel")
        role_every = dict(_mapping(self.role_every, "role_every"))
        for k, v in role_every.items():
            _enum(Role, k, "role_every key")
            _int(v, f"Config.role_every[{k!r}]", minimum=1)
        set_("role_every", FrozenMap(role_every))
        set_("formats", FrozenMap(_formats(self.formats)))
        set_("scales", FrozenMap(_scales(self.scales)))
        for name, cls in SUBCONFIGS.items():
            v = getattr(self, name)
            if not isinstance(v, cls):
                set_(name, _subconfig(name, v, None))
        if self.guard.on_nonfinite == "skip" and not self.sentinel:
            raise ValueError("Config.guard.on_nonfinite='skip' needs Config.sentinel=True (the "
                             "guard decides from the sentinel)")
        validate_processing_fields(self, set_)  # -- frame processing

    # -- presets and files ------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "Config":
        """Named presets (see PRESETS and docs/config.md): default, full, bf16, fp16, fp8,
        debug. Overrides take the same keywords as Config; a mapping for a sub-config updates
        the preset's."""
        if not isinstance(name, str) or name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}{did_you_mean(str(name), PRESETS)}; "
                             f"expected one of {sorted(PRESETS)}")
        base = cls(**_resolve(PRESETS[name], None))
        return base.replace(**overrides) if overrides else base

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Config":
        """A Config from plain data: top-level fields, one table (mapping) per sub-config,
        `preset = "..."` to start from a preset; flat names warn with their new spelling."""
        if not isinstance(data, Mapping):
            raise ValueError(f"Config.from_dict expects a mapping, got {type(data).__name__}")
        data = dict(data)
        base = data.pop("preset", None)
        unknown = [k for k in data if not isinstance(k, str)
                   or (k not in _FIELDS and k not in FLAT_NAMES)]
        if unknown:
            raise UnknownFieldError("unknown Config field(s) " + ", ".join(
                f"{k!r}{suggest(str(k), _FIELDS)}" for k in unknown))
        return cls.preset(base, **data) if base is not None else cls(**data)

    @classmethod
    def from_file(cls, path: "str | os.PathLike") -> "Config":
        """Load a .toml, .yaml/.yml or .json file (optionally with `preset = "..."`): top-level
        fields, and a table per sub-config ([drift], [sinks]...)."""
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
        except UnknownFieldError as e:
            raise UnknownFieldError(f"config file {path!r}: {e}") from None
        except ValueError as e:
            raise ValueError(f"config file {path!r}: {e}") from None

    def replace(self, **changes: Any) -> "Config":
        """A copy with `changes`: a sub-config instance replaces this one's, a mapping (or a
        flat name) updates it."""
        return dataclasses.replace(self, **_resolve(changes, self))

    # -- lookups used by the monitor ---------------------------------------------------------
    def format_for(self, role: str) -> Optional[str]:
        return _glob_lookup(self.formats, role)

    def scale_for(self, role: str) -> float:
        v = _glob_lookup(self.scales, role)
        return 1.0 if v is None else float(v)

    def role_enabled(self, role: Role) -> bool:
        return role in self.roles


_FIELDS = tuple(f.name for f in fields(Config))
_dataclass_init = Config.__init__


def _config_init(self, **kw: Any) -> None:
    _dataclass_init(self, **_resolve(kw, None))


_config_init.__wrapped__ = _dataclass_init  # help() and inspect show the fields
Config.__init__ = _config_init


def _resolve(kw: Mapping[str, Any], base: Optional[Config]) -> dict:
    """Keyword arguments with every sub-config resolved: flat names folded into their group
    (with a DeprecationWarning), mappings and list shorthands turned into sub-configs built on
    `base`'s (the defaults when None)."""
    direct, nested = split_flat(kw, _FIELDS)
    for group in set(nested) | {g for g in direct if g in SUBCONFIGS}:
        sub = getattr(base, group) if base is not None else None
        if group in direct:
            sub = _subconfig(group, direct[group], sub)
        elif sub is None:
            sub = SUBCONFIGS[group]()
        if group in nested:
            sub = build(SUBCONFIGS[group], nested[group], group, sub)
        direct[group] = sub
    return direct


def _subconfig(group: str, v: Any, base: Any):
    cls = SUBCONFIGS[group]
    if isinstance(v, cls):
        return v
    if group in SHORTHAND and isinstance(v, (str, tuple, list)):
        return build(cls, {SHORTHAND[group]: v}, group, base)
    if isinstance(v, Mapping):
        return build(cls, v, group, base)
    short = f", or a list (its {SHORTHAND[group]})" if group in SHORTHAND else ""
    raise ValueError(f"Config.{group} must be a {cls.__name__}, a mapping of its fields{short}; "
                     f"got {v!r}")


def _formats(v) -> dict:
    fmts = dict(_mapping(v, "formats"))
    for k, x in fmts.items():
        _glob_key(k, "formats")
        # Fmt is a str-mixin enum: str(Fmt.E4M3) is "Fmt.E4M3", so unwrap it first
        name = x.value if isinstance(x, enum.Enum) else x
        if not isinstance(name, str) or name.lower() not in {f.value for f in ROW_FORMATS}:
            names = ", ".join(f.value for f in ROW_FORMATS)
            raise ValueError(f"Config.formats[{k!r}] = {x!r}: expected one of {names}")
        fmts[k] = Fmt(name.lower()).value
    return fmts


def _scales(v) -> dict:
    scales = dict(_mapping(v, "scales"))
    for k, x in scales.items():
        _glob_key(k, "scales")
        # the kernels take the scale in float32: outside its normal range it would count as 0
        # or +inf (stats/scale.py)
        if (isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0
                or not math.isfinite(x) or not _FLT_MIN <= x <= _FLT_MAX):
            raise ValueError(f"Config.scales[{k!r}] must be a positive number within "
                             f"float32's normal range [2**-126, {_FLT_MAX:.7g}], got {x!r}")
        scales[k] = float(x)
    return scales


def _glob_lookup(table: Mapping[str, Any], role: str):
    if role in table:
        return table[role]
    for pat, v in table.items():
        if fnmatch.fnmatchcase(role, pat):
            return v
    return None


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
_FP16_FORMATS = {"output": "fp16", "input": "fp16", "weight": "fp16", "grad_output": "fp16",
                 "grad": "fp16"}
# name -> the fields it sets (a sub-config as a mapping of its fields); PRESET_DOCS says why.
PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "full": {"every": 1, "roles": tuple(Role)},
    "bf16": {"shadow_every": 5},
    "fp16": {"formats": _FP16_FORMATS},
    "fp8": {"formats": _FP8_FORMATS},
    "debug": {"every": 1, "roles": tuple(Role), "shadow_every": 1,
              "incidents": {"cooldown": 1}, "capture": {"snapshot": "every"}},
}
PRESET_DOCS: dict[str, str] = {
    "default": "Statistics every 10th step (every step for the first 10), the sentinel every "
               "step, no shadow replicas, no format: non-finite values, drift, spikes and "
               "weight updates are judged, ranges only where `formats` names a format.",
    "full": "Every role (inputs too) on every step: full coverage of a run whose step time "
            "can grow by about a tenth (README \"Performance\").",
    "bf16": "The default plus fp32 shadow replicas on every 5th sampled step: bf16 keeps fp32's "
            "range, so its risk is precision (8 significant bits), which only a higher-precision "
            "replay measures.",
    "fp16": "Every role judged against fp16's range (max 65504, subnormals below 2^-14): "
            "overflow and underflow of fp16 training, with or without a loss scaler.",
    "fp8": "Forward roles judged against E4M3 (max 448), backward roles against E5M2 "
           "(max 57344): the recipe of torchao's float8 training.",
    "debug": "Every role, every step, a shadow replica of every watched module on every step, "
             "every repeat alerted (cooldown 1), and a snapshot kept on every step so that even "
             "a loss-only alert is captured: for a small repro of a known-bad run.",
}
assert set(PRESET_DOCS) == set(PRESETS)
