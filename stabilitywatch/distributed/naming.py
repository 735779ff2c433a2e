"""How an alert on a merged row names the ranks: the rank range of its NaN/Inf (and the named
ranks' own counts, details.py), the one rank holding the largest |x| for physics and overflow
alerts, and the shard of the unsharded tensor that rank holds."""
from __future__ import annotations

import dataclasses

from . import reduce


def annotate(frame, a, world: int, shard_of):
    """The alert `a` on a merged frame, with the ranks it concerns in its rank, extra and
    message; `shard_of(key, rank)`: the dim-0 rows that rank holds, or None."""
    key = (a.module, a.tensor)
    i = frame.index(*key)
    if a.detector == "nonfinite":
        sentinel = a.extra.get("source") == "sentinel"
        r = frame.sentinel_bad.get(key) if sentinel else None
        detail = frame.sentinel_detail.get(key) if r is not None else None
        if r is None and i is not None:
            r = frame.bad_range.get(i)
            detail = frame.bad_detail.get(i)
            if r is None and frame.bad_ranks.get(i):
                ranks = frame.bad_ranks[i]
                r = (min(ranks), max(ranks), len(ranks))
        if r is None:
            return a
        lo, hi, n = r
        where = (f"rank {lo}" if lo == hi else f"ranks {lo}..{hi} ({n} ranks)")
        extra = {**a.extra, "ranks": reduce.listed(r), "rank_range": [lo, hi],
                 "rank_count": n}
        if detail:
            extra["rank_details"] = detail
    elif a.detector in ("physics", "overflow") and i is not None \
            and i in frame.absmax_rank:
        lo = frame.absmax_rank[i]
        where = f"largest |x| on rank {lo}"
        extra = {**a.extra, "ranks": [lo]}
    else:
        return a
    shard = shard_of(key, lo)
    if shard is not None:
        extra["shard"] = shard
        where += f", its shard: rows {shard['rows'][0]}..{shard['rows'][1] - 1}"
    return dataclasses.replace(a, rank=lo, extra=extra,
                               message=f"{a.message} [{where} of {world}]")

