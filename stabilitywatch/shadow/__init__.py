"""Higher-precision shadow replicas (runner: hooks; metrics: host-side error measures)."""
from .metrics import is_shadow_role, shadow_metrics, shadow_records
from .runner import ShadowRunner, shadow_targets, ulp_of

__all__ = ["ShadowRunner", "is_shadow_role", "shadow_metrics", "shadow_records", "shadow_targets",
           "ulp_of"]
