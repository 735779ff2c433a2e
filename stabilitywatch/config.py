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

from .capture import policy as _capture_policy
from .formats import ROW_FORMATS, Fmt
from .stats.scale import FLT_MAX as _FLT_MAX, FLT_MIN as _FLT_MIN
from .config_detectors import validate_detector_fields
from .config_incidents import validate_incident_fields
from .config_distributed import DistBackend, DistMode, validate_dist_fields
from .config_sinks import SINK_NAMES, validate_sink_fields  # noqa: F401 (SINK_NAMES: public)
from .config_dashboards import validate_dashboard_fields
from .config_sentinel import validate_sentinel_fields
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
    """Higher-precision shadow replicas on every N-th sampled step (0 = off): the modules of
    `shadow_modules` are re-run in `shadow_dtype` on the same inputs (see stabilitywatch/shadow)."""
    # -- detectors (drift, spike, shadow): README "Detectors and their defaults"; checked in
    # config_detectors.py. Defaults keep a healthy run free of warnings.
    detectors: tuple[str, ...] = ("drift", "spike", "shadow")
    """Extra detectors switched on (nonfinite, overflow and underflow are always on)."""
    shadow_modules: tuple[str, ...] = ()
    """Globs of module names that get a shadow replica. Empty: the watched modules."""
    shadow_dtype: str = "fp32"
    """Precision of the shadow replicas: "fp32" or "fp64"."""
    shadow_model: bool = False
    """Also re-run the whole model in `shadow_dtype` on shadow steps: the accumulated error of
    each shadowed module's output (stat `model_rel_l2`), at the cost of one more forward."""
    shadow_rel_warn: float = 0.1
    """Shadow: warning when a module's relative L2 error ||live - shadow|| / ||shadow|| exceeds
    this (bf16 rounding gives ~0.003, fp16 ~0.0005)."""
    shadow_rel_critical: float = 0.5
    """Shadow: critical above this relative L2 error."""
    shadow_growth: float = 10.0
    """Shadow: warning when a module's relative error is this many times its baseline (the
    median of its first `shadow_baseline` shadow steps)..."""
    shadow_growth_floor: float = 0.01
    """...and above this relative error (growth from a tiny error is not worth a warning)."""
    shadow_baseline: int = 5
    """Shadow steps that form each module's error baseline."""
    drift_stats: tuple[str, ...] = ("absmax", "rms")
    """Statistics whose log2 the drift detector follows, per (module, role)."""
    drift_exclude_roles: tuple[str, ...] = ("optim.*",)
    """Role globs the drift detector ignores: Adam's moments drift by design while they warm up
    (1 / (1 - beta2) steps); the gradients that feed them are followed."""
    drift_window: int = 50
    """Drift: sampled steps in each rolling baseline (median and MAD of log2 values)."""
    drift_min_history: int = 10
    """Drift: sampled steps seen before a series is judged."""
    drift_min_sigma_bits: float = 0.25
    """Drift: floor of the robust scale (1.4826 MAD) in bits, so a flat series is not 'noisy'."""
    drift_z: float = 6.0
    """Drift: robust score |x - median| / scale at which one sample counts as a jump."""
    drift_cusum_k: float = 0.5
    """Drift: CUSUM slack (in robust-score units) subtracted each step."""
    drift_cusum_h: float = 20.0
    """Drift: CUSUM decision threshold (in robust-score units): a change point."""
    drift_min_bits: float = 1.0
    """Drift: change points smaller than this many bits (x2) from the median are not reported."""
    drift_warn_bits: float = math.inf
    """Drift: a change point is a warning when the series moved at least this many bits from its
    median, an info alert otherwise. Default inf: change points are info (one fault moves many
    statistics; the range, spike and shadow detectors judge whether it matters), and drift's
    warning is the time-to-overflow forecast. 4 (x16) makes large moves warnings."""
    drift_forecast_points: int = 8
    """Time to overflow: sampled steps in the trend fit (Theil-Sen) of log2(absmax * scale)."""
    drift_forecast_horizon: int = 50
    """Time to overflow: warning when the fitted trend reaches the role's format max (from
    `formats`) within this many steps."""
    drift_forecast_max_bits: float = 5.0
    """Time to overflow: only values within this many bits (x32) of the format max are
    forecast; trends far from it (early training) are extrapolated too far to be trusted."""
    drift_forecast_min_tau: float = 0.7
    """Time to overflow: the fitted points must rise nearly monotonically (Kendall's tau of
    step vs value at least this), so one jump between flat stretches is not a trend."""
    drift_forecast_confidence: float = 0.9
    """Time to overflow: the lower bound of this confidence interval of the slope must be > 0."""
    spike_window: int = 50
    """Spike: values in each rolling window (loss every step; gradient norms on sampled steps)."""
    spike_min_history: int = 10
    """Spike: values seen before a series is judged."""
    spike_z: float = 6.0
    """Spike: robust score (x - median) / noise a spike must exceed, noise being the step-to-step
    scale 1.4826 * MAD(successive differences) / sqrt(2) over the window..."""
    spike_loss_rel: float = 0.5
    """...and, for the loss, a rise of at least this fraction of |median| (0.5: +50%)..."""
    spike_grad_bits: float = 3.0
    """...and, for the global gradient norm, at least this many bits (x8; early training of HF
    GPT-2 small jumps x2.8-x20 and recovers: smaller thresholds warn on clean runs)..."""
    spike_layer_grad_bits: float = 3.0
    """...and, for a module's gradient norm, at least this many bits (x8). Per-layer spikes are
    info alerts: one small module's norm is too noisy for a warning."""
    attn_logits: tuple[str, ...] = ()
    """Globs of modules whose output is attention logits (q.k/sqrt(d), before masking and
    softmax); also every `stabilitywatch.LogitsTap("attention")` in the model. Role `attn_logits`."""
    output_logits: tuple[str, ...] = ()
    """Globs of modules whose output is the model's output logits; also every
    `stabilitywatch.LogitsTap("output")`. Roles `logits` and `logz` (logsumexp over the last dim)."""
    spike_attn_logit_max: float = 50.0
    """Spike: warning when the largest |attention logit| exceeds this..."""
    spike_attn_growth_bits: float = 2.0
    """...or has grown this many bits (x4) above its early median (first `spike_min_history`
    samples) while above `spike_attn_floor`."""
    spike_attn_floor: float = 10.0
    spike_logz_drift: float = 10.0
    """Spike: warning when the mean log Z of the output logits moved this many nats away from
    its early median (output-logit divergence, Wortsman et al. 2023)."""
    # -- incidents and severities (stabilitywatch/incidents.py, detectors/physics.py; README
    # "Detectors and their defaults"); checked in config_incidents.py
    incident_warn_bits: float = 4.0
    """Incidents: a change point of at least this many bits (x16) from its median may be the
    root of an incident, and is then at least a warning (smaller ones are statistics)."""
    incident_critical_bits: float = 10.0
    """Incidents: a change point of at least this many bits (x1024) that is the root of an
    incident makes it critical."""
    spike_loss_recent: int = 5
    """Spike: the loss is judged against the lower of its window's median and the median of
    its last this-many values (its recent level, while it still falls)."""
    weight_update_margin: float = 2.0
    """Physics: a weight's max or min that moved more than this times the most its optimizer
    could move one element since the previous read (Adam/AdamW: a bound from lr and the betas;
    SGD: lr x gradient, momentum) is critical: a bad write or silent data corruption."""
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
    sinks: tuple[Any, ...] = ("jsonl", "console")
    """Any of: jsonl, console, wandb, tensorboard, and stabilitywatch.sinks.Sink instances
    (plug-in sinks, used as they are)."""
    wandb_project: str = "stabilitywatch"
    wandb_stats: tuple[str, ...] = ()
    """Statistics the dashboards (W&B and TensorBoard) show instead of `dashboard_stats`: the
    same entries without "default" (empty: `dashboard_stats` decides)."""
    # -- dashboards (W&B and TensorBoard sinks): README "Sinks, and the numbers in W&B";
    # checked in config_dashboards.py
    dashboard_stats: tuple[str, ...] = ("default",)
    """What the dashboards show per (module, role): "default" (absmax, rms, nonfinite, the
    overflow and underflow fractions of the role's configured format; loss mean, gradient norm,
    shadow rel_l2; biases and raw shadow rows left out), statistic names or globs added for the
    roles shown ("mean", "e5m2_*"), and "ROLE:STAT" globs for any role ("grad*:std",
    "*bias:absmax"). stats.jsonl keeps every statistic whatever this says."""
    dashboard_histograms: bool = True
    """Exponent histograms (floor(log2|x|) counts) of the rows shown, on sampled steps."""
    wandb_run: str = "auto"
    """Which W&B run the wandb sink logs to. "auto": the run you start with wandb.init, before
    or after watch(); if there is none by close(), a run of the monitor's own, started then.
    "attach": only yours (nothing reaches W&B without one). "own": a run of its own, started
    at watch() (then do not call wandb.init yourself in this process)."""
    queue_size: int = 1024
    """Steps of statistics records each sink's queue holds (when full, records are dropped for
    that sink, counted, never waited for; alerts have their own queue and are never dropped)."""
    # -- sinks (sinks/runner.py; README "Sinks"); checked in config_sinks.py
    sink_timeout: float = 10.0
    """Seconds one call of a sink (log, alert, flush) may take; a sink that takes longer is
    switched off (one warning, never called again) and what it had not written is counted in
    run.json. Training never waits for it either way."""
    sink_close_timeout: float = 30.0
    """Seconds close() gives the sinks in all to write what is queued and close; a sink not done
    by then is abandoned (one warning naming it; counted in run.json)."""
    backend: Backend = Backend.AUTO
    rank: Optional[int] = None
    """Rank for records; None: torch.distributed's rank when initialised, else 0."""
    # -- capture (capture/policy.py validates these; README "Post-mortem: capture and replay")
    capture: tuple[str, ...] = ("critical",)
    """Alerts that write a capture bundle of their step: "SEVERITY" (any detector at or above
    it), "DETECTOR" (any severity) or "DETECTOR:SEVERITY". () turns capture and snapshots off."""
    capture_dir: str = "captures"
    """Where bundles go: relative to run_dir, or an absolute path."""
    capture_max: int = 8
    """At most this many bundles in capture_dir."""
    capture_max_bytes: int = 4 * 1024**3
    """At most this many bytes of bundles in capture_dir."""
    capture_retention: _capture_policy.Retention = _capture_policy.Retention.KEEP_FIRST
    """At a limit: "keep_first" skips later captures (the first anomaly is the origin; later ones
    are mostly its consequences), "keep_last" deletes the oldest bundles to make room."""
    capture_snapshot: _capture_policy.SnapshotPolicy = _capture_policy.SnapshotPolicy.SAMPLED
    """When start-of-step state (weights, optimizer state, RNG, batch) is kept for a possible
    capture: "sampled" (steps that read more than the loss), "every", or "off"."""
    capture_snapshot_to: _capture_policy.SnapshotTarget = _capture_policy.SnapshotTarget.AUTO
    """Snapshot memory: "device" (a device copy: fast, costs device memory), "host" (pinned host
    memory, a device-to-host copy), "auto" (device while the ring takes <= 1% of it, else host)."""
    capture_ring: int = 2
    """Snapshots held at once: a step's state is kept until its statistics are read (one step
    later on CUDA), so 2 suffice unless the GPU runs more than a step behind the host."""
    # -- distributed (stabilitywatch/distributed; README "Many GPUs: torchrun"); checked in
    # config_distributed.py. Used only when torch.distributed runs with more than one rank.
    dist_mode: DistMode = DistMode.RANK0
    """"rank0": at each flush every rank's rows go to rank 0 in one collective; rank 0 merges
    them (activations and shards: sums add, min/max combine; replicated tensors: its own row)
    and alone writes alerts.jsonl and stats.jsonl. "per_rank": every rank writes its own rows
    to its own files (alerts.rank{r}.jsonl...); only fingerprints are exchanged."""
    dist_flush_every: int = 1
    """Collective flush at every N-th step end (the same step on every rank), carrying the
    frames of the steps before it; alerts arrive up to N steps later. Keep capture_ring >= N + 1
    for captures."""
    dist_divergence: bool = True
    """Compare fingerprints of parameters, gradients and optimizer state across ranks (they
    must be identical under DDP) and name the rank that differs (detector "divergence"). Switch
    off when ranks hold different plain-tensor parameters (pipeline or tensor parallelism
    without DTensor)."""
    dist_backend: DistBackend = DistBackend.GLOO
    """"gloo": the flush goes through a CPU gloo group made at watch() (never waits for the GPU,
    never mixes with the job's NCCL collectives); "default": the job's own group."""
    dist_timeout: float = 300.0
    """Seconds a flush collective may take; after that (a rank died) each rank goes on alone,
    writing per-rank files."""
    # -- sentinel, escalation and guard (README "Every step: the sentinel, escalation and the
    # guard"); checked in config_sentinel.py
    sentinel: bool = True
    """Every step, before the optimizer step, read every watched parameter gradient once (one
    multi-tensor launch): its NaN/Inf count, largest finite |x| and sum of squares."""
    escalate_steps: int = 20
    """A tripped sentinel or a warning-or-worse alert switches the next this-many steps to full
    sampling (every role); 0 = off. Multi-rank runs escalate on the cross-rank sentinel flag."""
    on_nonfinite: str = "warn"
    """"warn": alert only. "skip": a step whose gradients hold NaN/Inf is skipped on the device
    (fused torch.optim optimizers; others: one host check per step), see stabilitywatch/guard.py."""
    rerun_skipped: bool = False
    """With the guard and watch(step_fn=...): a skipped step is run again in place (its forward
    and backward, every role read, no optimizer step) to name the forward module where the
    values first went bad. Costs one host wait per step (stabilitywatch/inplace.py)."""
    update_stats: bool = True
    """On sampled steps that read weights, the optimizer update ||dW|| / ||W|| per module
    (role `update`, stat `update_ratio`), judged by the `update` detector."""
    update_spike_bits: float = 3.0
    """Update detector: warning when log2(update ratio) is this many bits above its median over
    the last `update_window` samples (and above the median's noise)."""
    update_window: int = 50
    update_min_history: int = 8
    """Samples of a module's update ratio before it is judged."""
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
        for name in ("modules", "exclude", "sinks", "wandb_stats", "module_types"):
            v = getattr(self, name)
            set_(name, tuple(v) if isinstance(v, (tuple, list)) else (v,))
        for t in self.module_types:
            if not isinstance(t, (str, type)):
                raise ValueError(f"Config.module_types must hold classes or class names, got {t!r}")
        for name in ("modules", "exclude", "wandb_stats"):
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
        validate_detector_fields(self, set_)
        validate_incident_fields(self, set_)  # -- incidents
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
            # the kernels take the scale in float32: outside its normal range it would count
            # as 0 or +inf (stats/scale.py)
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0
                    or not math.isfinite(v) or not _FLT_MIN <= v <= _FLT_MAX):
                raise ValueError(f"Config.scales[{k!r}] must be a positive number within "
                                 f"float32's normal range [2**-126, {_FLT_MAX:.7g}], got {v!r}")
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
        validate_sink_fields(self)  # -- sinks
        for k, v in _capture_policy.validate(self).items():  # -- capture
            set_(k, v)
        validate_dist_fields(self, set_)  # -- distributed
        validate_dashboard_fields(self, set_)  # -- dashboards
        validate_sentinel_fields(self, set_)  # -- sentinel, escalation and guard
        validate_processing_fields(self, set_)  # -- frame processing

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
