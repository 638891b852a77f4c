"""What the gateway and the workers agree on: the reuse plan a request carries, the recompute profile, and the
facts of a model folder that both plan by.

Plain dataclasses and JSON, no torch and no SGLang: the gateway imports this package, and so does the engine
extension inside each worker; neither imports the other.

- :mod:`plan.request`: ``RequestPlan`` / ``ImagePlan``, the versioned wire format, and its transport in SGLang's
  request id.
- :mod:`plan.outcome`: what a worker actually ran per image (``Outcome``), left for the gateway in ``OutcomeBox``.
- :mod:`plan.ratios`: per-layer recompute ratios (``check_ratios``, ``recompute_count``).
- :mod:`plan.profile`: ``RecomputeProfile``, written by ``offline.profiler`` and read by the gateway.
- :mod:`plan.checkpoint`: what a model folder's JSON files say (layers, dtype, image processor settings).
- :mod:`plan.video`: which video containers and codecs may cross to a worker, and how FFmpeg is told so (PyAV;
  imported by name, not from here).
"""

from plan.errors import PlanError
from plan.profile import PROFILE_FILE, RecomputeProfile
from plan.ratios import DEFAULT_RECOMPUTE_RATIO, check_ratios, recompute_count
from plan.request import (
    APPROXIMATE,
    ATTENTION_ONLY,
    CACHEBLEND,
    CHANGE_AWARE,
    CHANGE_BLIND,
    CHANGED,
    DOWNSTREAM,
    ENTROPY_AWARE,
    EXACT,
    FULL_PASS,
    FULL_REUSE,
    MISS,
    PARTIAL_PASS,
    PLAN_KINDS,
    PLAN_VERSION,
    PUBLIC_PLAN_KEY,
    RID_PREFIX,
    SAME,
    SELECTORS,
    SIMILAR,
    VISION_PASSES,
    VLCACHE,
    ImagePlan,
    RequestPlan,
    plan_key,
)

__all__ = [
    "APPROXIMATE", "ATTENTION_ONLY", "CACHEBLEND", "CHANGE_AWARE", "CHANGE_BLIND", "CHANGED",
    "DEFAULT_RECOMPUTE_RATIO", "DOWNSTREAM",
    "ENTROPY_AWARE", "EXACT", "FULL_PASS", "FULL_REUSE", "MISS", "PARTIAL_PASS", "PLAN_VERSION", "PROFILE_FILE",
    "PUBLIC_PLAN_KEY", "RID_PREFIX", "SAME", "SELECTORS", "SIMILAR", "PLAN_KINDS", "VISION_PASSES", "VLCACHE",
    "ImagePlan", "PlanError", "RecomputeProfile", "RequestPlan", "check_ratios", "plan_key", "recompute_count",
]
