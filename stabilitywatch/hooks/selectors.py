"""Which modules to watch: qualified-name globs, module types, or a predicate."""
from __future__ import annotations

import difflib
import fnmatch

import torch.nn as nn

from ..config import Config, Role

# the roles read from watched modules; the loss (and the batch, module "") need none
MODULE_ROLES = frozenset(Role) - {Role.LOSS}


def _type_hit(module: nn.Module, t) -> bool:
    if isinstance(t, type):
        return isinstance(module, t)
    return any(c.__name__ == t or f"{c.__module__}.{c.__qualname__}" == t
               for c in type(module).__mro__)


def _default(module: nn.Module) -> bool:
    # every leaf module that owns parameters
    return next(module.children(), None) is None and next(module.parameters(False), None) is not None


def _type_name(t) -> str:
    return t if isinstance(t, str) else t.__name__


def select_modules(model: nn.Module, config: Config) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) pairs to watch, in model.named_modules() order.

    Raises ValueError when a name glob or a `module_types` entry matches no module of the model
    (a typo should not silently watch nothing), and when the selection as a whole watches no
    module while module roles are read (everything excluded, a `select` that is never true, a
    model without parameters). A config that reads no module role (`roles=("loss",)`) may
    select nothing."""
    named = list(model.named_modules())
    explicit = bool(config.modules or config.module_types or config.select)
    chosen = []
    hits = {p: 0 for p in config.modules}
    type_hits = {i: 0 for i in range(len(config.module_types))}
    for name, mod in named:
        # globs and types are judged before exclude: an entry that names only excluded modules
        # is not a typo, and the empty selection that follows says which exclude did it
        globs = [p for p in config.modules if fnmatch.fnmatchcase(name, p)]
        types = [i for i, t in enumerate(config.module_types) if _type_hit(mod, t)]
        for p in globs:
            hits[p] += 1
        for i in types:
            type_hits[i] += 1
        if any(fnmatch.fnmatchcase(name, p) for p in config.exclude):
            continue
        if not explicit:
            ok = _default(mod)
        else:
            ok = bool(globs or types) or bool(config.select and config.select(name, mod))
        if ok:
            chosen.append((name, mod))
    missing = [p for p, n in hits.items() if n == 0]
    if missing:
        raise ValueError(f"stabilitywatch: module pattern(s) {missing} match no module of the "
                         f"model; names look like: {_sample_names(named)}")
    no_type = [_type_name(config.module_types[i]) for i, n in type_hits.items() if n == 0]
    if no_type:
        close = difflib.get_close_matches(no_type[0], {type(m).__name__ for _, m in named}, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"stabilitywatch: module_types {no_type} match no module of the model; "
                         f"its module types are: {_sample_types(named)}{hint}")
    if not chosen and MODULE_ROLES & set(config.roles):
        raise ValueError(f"stabilitywatch: the module selection ({_asked(config)}) watches no "
                         f"module of the model; names look like: {_sample_names(named)}; types: "
                         f"{_sample_types(named)}. To read only the loss, pass "
                         f"roles=('loss',)")
    return chosen


def _asked(config: Config) -> str:
    parts = [f"{k}={getattr(config, k)!r}" for k in ("modules", "exclude") if getattr(config, k)]
    if config.module_types:
        parts.append(f"module_types={[_type_name(t) for t in config.module_types]}")
    if config.select is not None:
        parts.append(f"select={getattr(config.select, '__qualname__', repr(config.select))}")
    if not (config.modules or config.module_types or config.select):
        parts.insert(0, "default: every leaf module that owns parameters")
    return ", ".join(parts)


def _sample_names(named) -> str:
    return ", ".join(repr(n) for n, _ in named[1:8]) or repr(named[0][0])


def _sample_types(named) -> str:
    seen: list[str] = []
    for _, mod in named:
        n = type(mod).__name__
        if n not in seen:
            seen.append(n)
    return ", ".join(seen[:12]) + (", ..." if len(seen) > 12 else "")
