"""Rewrite reads of flat Config names (`cfg.drift_window`, `Config.capture_dir`) to their nested
spelling (`cfg.drift.window`, `Config.capture.dir`) in the files given, from the one rename
table, stabilitywatch/config_flat.py's FLAT_NAMES.

    python tools/config_rename.py stabilitywatch/foo.py tests/test_foo.py

Only attribute reads on a config-like name are rewritten (cfg, config, c, Config, self.config,
mon.config, monitor.config, self.cfg). Keyword arguments (`Config(drift_window=...)`) keep
working through the deprecation path; `cfg.sinks` and `cfg.capture` (now sub-configs, read
`.sinks.use` and `.capture.triggers`) are listed for a look by hand."""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECEIVERS = r"(?:self\.config|self\.cfg|mon\.config|monitor\.config|cfg|config|Config|c)"


def rename(text: str, flat_names: dict[str, str]) -> str:
    names = "|".join(sorted(flat_names, key=len, reverse=True))
    rx = re.compile(rf"\b({RECEIVERS})\.({names})\b")
    return rx.sub(lambda m: f"{m.group(1)}.{flat_names[m.group(2)]}", text)


def by_hand(text: str) -> list[int]:
    """Lines that read `.sinks` or `.capture` of a config as the old list."""
    rx = re.compile(rf"\b{RECEIVERS}\.(sinks|capture)\b(?!\.)")
    return [i + 1 for i, line in enumerate(text.splitlines()) if rx.search(line)]


def main(paths: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    from stabilitywatch.config_flat import FLAT_NAMES
    for p in map(Path, paths):
        text = p.read_text()
        new = rename(text, FLAT_NAMES)
        if new != text:
            p.write_text(new)
            print(f"rewrote {p}")
        for line in by_hand(new):
            print(f"{p}:{line}: reads .sinks or .capture (now .sinks.use / .capture.triggers?)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
