"""Which modules to watch: qualified-name globs, module types, or a predicate."""
from __future__ import annotations

import fnmatch

import torch.nn as nn

from ..config import Config


def _type_match(module: nn.Module, types) -> bool:
    for t in types:
        if isinstance(t, type) and isinstance(module, t):
            return True
        if isinstance(t, str) and any(c.__name__ == t or f"{c.__module__}.{c.__qualname__}" == t
                                      for c in type(module).__mro__):
            return True
    return False


def _default(module: nn.Module) -> bool:
    # every leaf module that owns parameters
    return next(module.children(), None) is None and next(module.parameters(False), None) is not None


def select_modules(model: nn.Module, config: Config) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) pairs to watch, in model.named_modules() order.

    Raises ValueError when a name glob matches nothing (a typo should not silently watch
    nothing)."""
    named = list(model.named_modules())
    explicit = bool(config.modules or config.module_types or config.select)
    chosen, hits = [], {p: 0 for p in config.modules}
    for name, mod in named:
        if any(fnmatch.fnmatchcase(name, p) for p in config.exclude):
            continue
        if not explicit:
            ok = _default(mod)
        else:
            ok = False
            for p in config.modules:
                if fnmatch.fnmatchcase(name, p):
                    hits[p] += 1
                    ok = True
            ok = ok or _type_match(mod, config.module_types)
            ok = ok or bool(config.select and config.select(name, mod))
        if ok:
            chosen.append((name, mod))
    missing = [p for p, n in hits.items() if n == 0]
    if missing:
        sample = ", ".join(repr(n) for n, _ in named[1:8])
        raise ValueError(f"stabilitywatch: module pattern(s) {missing} match no module of the "
                         f"model; names look like: {sample}")
    return chosen
