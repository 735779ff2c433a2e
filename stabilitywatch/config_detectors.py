"""Sub-configs of the drift, spike and shadow detectors (`Config.drift`, `Config.spike`,
`Config.shadow`; README "Detectors and their defaults"). Defaults keep a healthy run free of
warnings.

It imports nothing from the package but config_base (config.py imports it)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .config_base import (check_bool, check_choices, check_int, check_number, check_strings,
                          not_above)

DETECTOR_NAMES = ("drift", "spike", "shadow")
SHADOW_DTYPES = ("fp32", "fp64")
DRIFT_STATS = ("absmax", "rms", "l2norm", "absmin_nonzero")


def _set(obj, name, value):
    object.__setattr__(obj, name, value)  # frozen dataclass: normalise in __post_init__


@dataclass(frozen=True, kw_only=True)
class DriftConfig:
    """The drift detector: change points (CUSUM on robust scores) and the time-to-overflow
    forecast of each (module, role) series, on sampled steps."""
    stats: tuple[str, ...] = ("absmax", "rms")
    """Statistics whose log2 the drift detector follows, per (module, role)."""
    exclude_roles: tuple[str, ...] = ("optim.*",)
    """Role globs the drift detector ignores: Adam's moments drift by design while they warm up
    (1 / (1 - beta2) steps); the gradients that feed them are followed."""
    window: int = 50
    """Sampled steps in each rolling baseline (median and MAD of log2 values)."""
    min_history: int = 10
    """Sampled steps seen before a series is judged."""
    min_sigma_bits: float = 0.25
    """Floor of the robust scale (1.4826 MAD) in bits, so a flat series is not 'noisy'."""
    z: float = 6.0
    """Robust score |x - median| / scale at which one sample counts as a jump."""
    cusum_k: float = 0.5
    """CUSUM slack (in robust-score units) subtracted each step."""
    cusum_h: float = 20.0
    """CUSUM decision threshold (in robust-score units): a change point."""
    min_bits: float = 1.0
    """Change points smaller than this many bits (x2) from the median are not reported."""
    warn_bits: float = math.inf
    """A change point is a warning when the series moved at least this many bits from its
    median, an info alert otherwise. Default inf: change points are info (one fault moves many
    statistics; the range, spike and shadow detectors judge whether it matters), and drift's
    warning is the time-to-overflow forecast. 4 (x16) makes large moves warnings."""
    forecast_points: int = 8
    """Time to overflow: sampled steps in the trend fit (Theil-Sen) of log2(absmax * scale)."""
    forecast_horizon: int = 50
    """Time to overflow: warning when the fitted trend reaches the role's format max (from
    `formats`) within this many steps."""
    forecast_max_bits: float = 5.0
    """Time to overflow: only values within this many bits (x32) of the format max are
    forecast; trends far from it (early training) are extrapolated too far to be trusted."""
    forecast_min_tau: float = 0.7
    """Time to overflow: the fitted points must rise nearly monotonically (Kendall's tau of
    step vs value at least this), so one jump between flat stretches is not a trend."""
    forecast_confidence: float = 0.9
    """Time to overflow: the lower bound of this confidence interval of the slope must be > 0."""

    def __post_init__(self) -> None:
        for name in ("stats", "exclude_roles"):
            _set(self, name, check_strings(getattr(self, name), f"drift.{name}"))
        check_choices(self.stats, DRIFT_STATS, "drift.stats")
        for name, lo in (("window", 3), ("min_history", 2), ("forecast_points", 3),
                         ("forecast_horizon", 1)):
            check_int(getattr(self, name), f"drift.{name}", lo)
        for name, lo, hi, strict in (("z", 0.0, None, True), ("min_sigma_bits", 0.0, None, True),
                                     ("cusum_k", 0.0, None, False), ("cusum_h", 0.0, None, True),
                                     ("min_bits", 0.0, None, False),
                                     ("warn_bits", 0.0, None, True),
                                     ("forecast_max_bits", 0.0, None, True),
                                     ("forecast_min_tau", -1.0, 1.0, False),
                                     ("forecast_confidence", 0.5, 1.0, True)):
            _set(self, name, check_number(getattr(self, name), f"drift.{name}", lo, hi, strict,
                                          may_be_inf=name == "warn_bits"))
        not_above(self.min_history, self.window, "drift.min_history", "drift.window")


@dataclass(frozen=True, kw_only=True)
class SpikeConfig:
    """The spike detector: the loss every step, gradient norms and the logit taps on sampled
    steps, each against a rolling median and its step-to-step noise."""
    window: int = 50
    """Values in each rolling window (loss every step; gradient norms on sampled steps)."""
    min_history: int = 10
    """Values seen before a series is judged."""
    z: float = 6.0
    """Robust score (x - median) / noise a spike must exceed, noise being the step-to-step
    scale 1.4826 * MAD(successive differences) / sqrt(2) over the window..."""
    loss_rel: float = 0.5
    """...and, for the loss, a rise of at least this fraction of |median| (0.5: +50%)..."""
    grad_bits: float = 3.0
    """...and, for the global gradient norm, at least this many bits (x8; early training of HF
    GPT-2 small jumps x2.8-x20 and recovers: smaller thresholds warn on clean runs)..."""
    layer_grad_bits: float = 3.0
    """...and, for a module's gradient norm, at least this many bits (x8). Per-layer spikes are
    info alerts: one small module's norm is too noisy for a warning."""
    loss_recent: int = 5
    """The loss is judged against the lower of its window's median and the median of its last
    this-many values (its recent level, while it still falls)."""
    attn_logit_max: float = 50.0
    """Warning when the largest |attention logit| exceeds this..."""
    attn_growth_bits: float = 2.0
    """...or has grown this many bits (x4) above its early median (first `min_history`
    samples) while above `attn_floor`."""
    attn_floor: float = 10.0
    """The largest |attention logit| below which growth is not judged (see
    `attn_growth_bits`)."""
    logz_drift: float = 10.0
    """Warning when the mean log Z of the output logits moved this many nats away from its
    early median (output-logit divergence, Wortsman et al. 2023)."""

    def __post_init__(self) -> None:
        for name, lo in (("window", 3), ("min_history", 2), ("loss_recent", 1)):
            check_int(getattr(self, name), f"spike.{name}", lo)
        for name in ("z", "loss_rel", "grad_bits", "layer_grad_bits", "attn_logit_max",
                     "attn_growth_bits", "logz_drift"):
            _set(self, name, check_number(getattr(self, name), f"spike.{name}", 0.0, strict=True))
        _set(self, "attn_floor", check_number(self.attn_floor, "spike.attn_floor", 0.0))
        not_above(self.min_history, self.window, "spike.min_history", "spike.window")


@dataclass(frozen=True, kw_only=True)
class ShadowConfig:
    """Higher-precision shadow replicas (stabilitywatch/shadow) and the shadow detector's
    thresholds. How often they run is `Config.shadow_every`."""
    modules: tuple[str, ...] = ()
    """Globs of module names that get a shadow replica. Empty: the watched modules."""
    dtype: str = "fp32"
    """Precision of the shadow replicas: "fp32" or "fp64"."""
    model: bool = False
    """Also re-run the whole model in `dtype` on shadow steps: the accumulated error of each
    shadowed module's output (stat `model_rel_l2`), at the cost of one more forward."""
    rel_warn: float = 0.1
    """Warning when a module's relative L2 error ||live - shadow|| / ||shadow|| exceeds this
    (bf16 rounding gives ~0.003, fp16 ~0.0005)."""
    rel_critical: float = 0.5
    """Critical above this relative L2 error."""
    growth: float = 10.0
    """Warning when a module's relative error is this many times its baseline (the median of
    its first `baseline` shadow steps)..."""
    growth_floor: float = 0.01
    """...and above this relative error (growth from a tiny error is not worth a warning)."""
    baseline: int = 5
    """Shadow steps that form each module's error baseline."""

    def __post_init__(self) -> None:
        _set(self, "modules", check_strings(self.modules, "shadow.modules"))
        if self.dtype not in SHADOW_DTYPES:
            raise ValueError(f"Config.shadow.dtype must be one of {SHADOW_DTYPES}, "
                             f"got {self.dtype!r}")
        check_bool(self.model, "shadow.model")
        check_int(self.baseline, "shadow.baseline", 1)
        for name, lo, strict in (("rel_warn", 0.0, True), ("rel_critical", 0.0, True),
                                 ("growth", 1.0, True), ("growth_floor", 0.0, False)):
            _set(self, name, check_number(getattr(self, name), f"shadow.{name}", lo,
                                          strict=strict))
        not_above(self.rel_warn, self.rel_critical, "shadow.rel_warn", "shadow.rel_critical")
