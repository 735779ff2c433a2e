"""Launch plans: what `StatsBuffer.add_many` did for one list of tensors, kept to do again
without host work per tensor while tensors of the same kinds (shape, dtype, device, rows) come
back: the taps over parameters, gradients and optimizer state pass such a list every sampled
step. Gradients set to None between steps come back at other addresses: the launches then only
take the new addresses (`rebind`). No tensor references (they would keep freed gradients
alive)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class ManyPlan:
    shape: tuple
    addrs: tuple
    slots: list[int]
    launches: list                    # (device, kept launch, [(item index, element offset)])
    singles: list[tuple[int, int]]    # (item index, slot): their own launch each
    span: tuple[int, int]             # the rows the launches write lie in [lo, hi)


def many_sig(items: list) -> Optional[tuple[tuple, tuple]]:
    """(the kinds of the items, their addresses); None: not cacheable (a tensor-valued scale:
    its value is on the device, and reading it would sync)."""
    tensor = torch.Tensor
    # list comprehensions, not generators: the taps pass hundreds of items every sampled step
    if [s for _, _, _, s in items if isinstance(s, tensor)]:
        return None
    try:
        return (tuple([(t.numel(), t.stride(), t.dtype, t.device, m, r, float(s))
                       for t, m, r, s in items]),
                tuple([t.data_ptr() for t, _, _, _ in items]))
    except (TypeError, RuntimeError, ValueError):
        return None


def rebind(plan: ManyPlan, items: list, addrs: tuple) -> bool:
    """The plan's launches on the items' new addresses; False: a launch cannot take them."""
    for _, launch, src in plan.launches:
        if not launch.rebind([addrs[k] + off * items[k][0].element_size() for k, off in src]):
            return False
    plan.addrs = addrs
    return True
