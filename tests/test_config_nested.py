"""The nested Config: sub-configs, hashing, the flat spellings (DeprecationWarning naming the new
one), nested tables in config files, and "did you mean" for unknown names."""
import dataclasses
import enum
import json
import pickle
import re
import warnings

import pytest

import stabilitywatch as sw
from stabilitywatch.capture.treeio import config_from_json, config_to_json
from stabilitywatch.config import SUBCONFIGS, Config
from stabilitywatch.config_flat import FLAT_NAMES
from stabilitywatch.sinks.dashboard import run_config


# -- shape ------------------------------------------------------------------------------------
def test_subconfigs_are_public_frozen_keyword_only():
    for name, cls in SUBCONFIGS.items():
        assert getattr(sw, cls.__name__) is cls
        sub = getattr(Config(), name)
        assert type(sub) is cls
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(sub, dataclasses.fields(cls)[0].name, None)
        with pytest.raises(TypeError):
            cls(1)


def test_every_config_hashes_and_equal_configs_hash_equal():
    def build():
        return Config(formats={"output": "e4m3", "grad*": "e5m2"}, scales={"grad": 1024.0},
                      role_every={"optim": 100}, drift=sw.DriftConfig(window=80),
                      sinks=sw.SinkConfig(use=("jsonl",), dashboard_stats=("default", "mean")))
    a, b = build(), build()
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert a != a.replace(scales={"grad": 512.0}) and a != a.replace(drift={"z": 7.0})
    for name in PRESETS_AND_DEFAULT:
        hash(Config.preset(name))
    for name in SUBCONFIGS:
        hash(getattr(a, name))
    with pytest.raises(TypeError):
        a.formats["weight"] = "e4m3"
    assert pickle.loads(pickle.dumps(a)) == a


PRESETS_AND_DEFAULT = ("default", "full", "bf16", "fp16", "fp8", "debug")


def test_mapping_updates_the_base_and_an_instance_replaces_it():
    c = Config(drift={"window": 80, "z": 7.0})
    assert (c.drift.window, c.drift.z, c.drift.cusum_h) == (80, 7.0, sw.DriftConfig().cusum_h)
    d = c.replace(drift={"z": 9.0})
    assert (d.drift.window, d.drift.z) == (80, 9.0)
    assert c.replace(drift=sw.DriftConfig(z=9.0)).drift.window == sw.DriftConfig().window
    e = c.replace(sinks=["jsonl"])                   # the list shorthand keeps the other fields
    assert e.sinks.use == ("jsonl",) and e.sinks.queue_size == c.sinks.queue_size
    assert Config(capture=()).capture.triggers == () and Config(capture="warning").capture \
        == sw.CaptureConfig(triggers=("warning",))


# -- the flat spellings -----------------------------------------------------------------------
def _other_value(cls, name):
    """A valid value of cls.<name> other than its default, found by trying a few candidates."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    d = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if isinstance(d, bool):
        cands = [not d]
    elif isinstance(d, enum.Enum):
        cands = [m.value for m in type(d) if m is not d]
    elif isinstance(d, int):
        cands = [d + 1, d - 1]
    elif isinstance(d, float):
        cands = [4.0] if d == float("inf") else [d / 2, d * 2, d + 1, 0.75, 1e-4]
    elif isinstance(d, str):
        cands = ["fp64", "own", "elsewhere"]
    else:
        cands = [(), d[:1], ("blocks.*",)]
    for v in cands:
        try:
            if getattr(cls(**{name: v}), name) != d:
                return v
        except ValueError:
            continue
    raise AssertionError(f"no other valid value found for {cls.__name__}.{name}")


FLAT = [k for k in FLAT_NAMES if k not in ("wandb_stats", "on_nonfinite", "rerun_skipped")]


@pytest.mark.parametrize("flat", FLAT, ids=FLAT)
def test_flat_keyword_warns_with_the_new_spelling_and_sets_the_nested_field(flat):
    group, _, sub = FLAT_NAMES[flat].partition(".")
    value = _other_value(SUBCONFIGS[group], sub)
    with pytest.warns(DeprecationWarning, match=re.escape(f"'{group}.{sub}'")):
        c = Config(**{flat: value})
    assert c == Config(**{group: {sub: value}})
    assert c != Config()


def test_flat_guard_and_dashboard_names():
    with pytest.warns(DeprecationWarning) as rec:
        c = Config(on_nonfinite="skip", rerun_skipped=True)
    said = " ".join(str(w.message) for w in rec)
    assert "'guard.on_nonfinite'" in said and "'guard.rerun_skipped'" in said
    assert c.guard == sw.GuardConfig(on_nonfinite="skip", rerun_skipped=True)
    with pytest.warns(DeprecationWarning, match="sinks.dashboard_stats"):
        assert Config(wandb_stats=("l2norm",)).sinks.dashboard_stats == ("l2norm",)
    with pytest.warns(DeprecationWarning):
        assert Config(wandb_stats=()).sinks == sw.SinkConfig()     # empty: dashboard_stats decides


def test_flat_names_merge_with_nested_values_and_into_replace():
    with pytest.warns(DeprecationWarning):
        c = Config(drift={"z": 8.0}, drift_window=80, sinks=["jsonl"], queue_size=3)
    assert (c.drift.z, c.drift.window) == (8.0, 80)
    assert (c.sinks.use, c.sinks.queue_size) == (("jsonl",), 3)
    with pytest.warns(DeprecationWarning):
        d = c.replace(drift_cusum_h=30.0)
    assert (d.drift.z, d.drift.window, d.drift.cusum_h) == (8.0, 80, 30.0)
    with pytest.warns(DeprecationWarning):
        assert Config.preset("debug", alert_cooldown=7).incidents.cooldown == 7


def test_the_warning_points_at_the_line_that_used_the_flat_name():
    with pytest.warns(DeprecationWarning) as rec:
        Config(drift_window=80)
        Config.preset("debug", alert_cooldown=7)
        Config().replace(queue_size=3)
    assert [w.filename for w in rec] == [__file__] * 3


def test_flat_map_names_every_nested_field_once():
    nested = {f"{g}.{f.name}" for g, cls in SUBCONFIGS.items() for f in dataclasses.fields(cls)}
    targets = set(FLAT_NAMES.values())
    assert targets <= nested
    # every nested field but the shorthands' own lists has a flat spelling
    assert nested - targets == {"capture.triggers", "sinks.use"}
    assert not set(FLAT_NAMES) & {f.name for f in dataclasses.fields(Config)}


def test_nested_spelling_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Config(drift={"window": 80}, sinks=["jsonl"], capture=(), guard=sw.GuardConfig())
        Config.preset("debug", incidents={"cooldown": 3}).replace(every=3)


# -- did you mean -----------------------------------------------------------------------------
@pytest.mark.parametrize("kw, needle", [
    ({"evry": 3}, "did you mean 'every'"),
    ({"drift_windw": 3}, "did you mean 'drift.window'"),
    ({"drift": {"windw": 3}}, "did you mean 'drift.window'"),
    ({"sinks": {"queue_sise": 3}}, "did you mean 'sinks.queue_size'"),
    ({"drfit": {"window": 3}}, "did you mean 'drift'"),
    ({"sinks": ["jsnol"]}, "did you mean 'jsonl'"),
    ({"detectors": ["spiek"]}, "did you mean 'spike'"),
    ({"capture": {"retention": "keep_frist"}}, "did you mean 'keep_first'"),
], ids=["top", "flat", "nested", "sinks-field", "group", "sink-name", "detector", "enum"])
def test_unknown_names_suggest_the_closest(kw, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        Config(**kw)


def test_unknown_preset_suggests_the_closest():
    with pytest.raises(ValueError, match=re.escape("did you mean 'fp8'")):
        Config.preset("fp9")


# -- files: nested tables, flat keys ----------------------------------------------------------
NESTED = {
    "cfg.toml": """
[stabilitywatch]
preset = "debug"
every = 4
sinks = ["jsonl"]
[stabilitywatch.drift]
window = 80
z = 7.0
[stabilitywatch.incidents]
warn_bits = 3.0
[stabilitywatch.capture]
triggers = ["warning"]
ring = 3
""",
    "cfg.yaml": """
preset: debug
every: 4
sinks: [jsonl]
drift: {window: 80, z: 7.0}
incidents: {warn_bits: 3.0}
capture: {triggers: [warning], ring: 3}
""",
    "cfg.json": json.dumps({"preset": "debug", "every": 4, "sinks": ["jsonl"],
                            "drift": {"window": 80, "z": 7.0}, "incidents": {"warn_bits": 3.0},
                            "capture": {"triggers": ["warning"], "ring": 3}}),
}


@pytest.mark.parametrize("name", sorted(NESTED), ids=sorted(NESTED))
def test_from_file_nested_tables(tmp_path, name):
    if name.endswith(".yaml"):
        pytest.importorskip("yaml")
    p = tmp_path / name
    p.write_text(NESTED[name])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = Config.from_file(p)
    assert c.every == 4 and c.sinks.use == ("jsonl",)
    assert (c.drift.window, c.drift.z) == (80, 7.0)
    assert c.incidents.warn_bits == 3.0 and c.incidents.cooldown == 1      # the preset's kept
    assert c.capture.triggers == ("warning",) and c.capture.ring == 3
    assert c.capture.snapshot.value == "every"                               # the preset's kept


def test_from_file_flat_keys_warn_and_mean_the_same(tmp_path):
    flat, nested = tmp_path / "flat.toml", tmp_path / "nested.toml"
    flat.write_text("drift_window = 80\nalert_cooldown = 3\nsink_timeout = 2.5\n")
    nested.write_text("[drift]\nwindow = 80\n[incidents]\ncooldown = 3\n[sinks]\ntimeout = 2.5\n")
    with pytest.warns(DeprecationWarning) as rec:
        c = Config.from_file(flat)
    said = " ".join(str(w.message) for w in rec)
    assert "'drift.window'" in said and "'incidents.cooldown'" in said and "'sinks.timeout'" in said
    assert c == Config.from_file(nested)


@pytest.mark.parametrize("text, needle", [
    ("[drift]\nwindw = 3\n", "did you mean 'drift.window'"),
    ("[drfit]\nwindow = 3\n", "did you mean 'drift'"),
    ("shadow_evry = 2\n", "did you mean 'shadow_every'"),
    ("[drift]\nwindow = 2\n", "Config.drift.window must be an integer >= 3"),
    ("drift = 3\n", "Config.drift must be a DriftConfig"),
], ids=["nested-typo", "table-typo", "top-typo", "nested-bad-value", "group-not-table"])
def test_from_file_errors_name_the_file_and_the_field(tmp_path, text, needle):
    p = tmp_path / "cfg.toml"
    p.write_text(text)
    with pytest.raises(ValueError) as ei:
        Config.from_file(p)
    assert str(p) in str(ei.value) and needle in str(ei.value)


# -- what run.json and capture bundles hold ---------------------------------------------------
def test_config_json_round_trip_and_older_flat_bundles():
    c = Config.preset("fp8", every=3, drift={"window": 80, "warn_bits": float("inf")},
                      sinks=["jsonl"], capture={"triggers": ("warning",), "ring": 4})
    data = json.loads(json.dumps(config_to_json(c)))
    assert data["drift"]["window"] == 80 and data["capture"]["ring"] == 4
    assert config_from_json(data) == c
    older = {"every": 3, "drift_window": 80, "alert_cooldown": 2, "capture": ["warning"],
             "sinks": ["jsonl"], "wandb_stats": [], "capture_ring": 4, "no_such_field": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # replaying an old bundle does not warn
        d = config_from_json(older)
    assert (d.every, d.drift.window, d.incidents.cooldown) == (3, 80, 2)
    assert d.capture.triggers == ("warning",) and d.capture.ring == 4
    assert d.sinks.use == ("jsonl",) and d.sinks.dashboard_stats == ("default",)


def test_run_config_writes_sub_configs_as_tables():
    out = json.loads(json.dumps(run_config(Config(drift={"window": 80}), 0, 1)))
    assert out["drift"]["window"] == 80 and out["sinks"]["use"] == ["jsonl", "console"]


def test_rename_tool_rewrites_reads_of_flat_names():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "tools" / "config_rename.py"
    spec = importlib.util.spec_from_file_location("config_rename", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    src = ("w = Window(cfg.drift_window)\nn = self.config.alert_cooldown\n"
           "q = self.queue_size\nif config.capture:\n")
    out = tool.rename(src, FLAT_NAMES)
    assert out == ("w = Window(cfg.drift.window)\nn = self.config.incidents.cooldown\n"
                   "q = self.queue_size\nif config.capture:\n")
    assert tool.by_hand(out) == [4]
