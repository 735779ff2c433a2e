"""Config: defaults, validation (a clear ValueError naming the field), presets, file loaders,
glob lookups, and the sampling schedule built from it."""
import dataclasses
import json
import os
import pickle

import pytest
import torch.nn as nn

import stabilitywatch as sw
from stabilitywatch.config import (DEFAULT_ROLES, PRESET_DOCS, PRESETS, SINK_NAMES, SUBCONFIGS,
                                   Backend, Config, Role)
from stabilitywatch.formats import Fmt
from stabilitywatch.schedule import Schedule


# -- defaults ---------------------------------------------------------------------------------
def test_defaults():
    c = Config()
    assert c.modules == () and c.module_types == () and c.select is None and c.exclude == ()
    assert c.roles == DEFAULT_ROLES
    assert Role.INPUT not in c.roles                     # off by default: a read per module
    assert c.every == 10 and c.warmup == 10 and c.shadow_every == 0
    assert c.role_every == {} and c.formats == {} and c.scales == {}
    assert 0 <= c.range.overflow_warn <= c.range.overflow_critical <= 1
    assert 0 <= c.range.underflow_warn <= c.range.underflow_critical <= 1
    assert c.sinks.use == ("jsonl", "console") and set(c.sinks.use) <= set(SINK_NAMES)
    assert c.backend is Backend.AUTO and c.rank is None
    assert c.sinks.queue_size >= 1 and c.range.min_numel >= 0 and c.incidents.cooldown >= 0


def test_public_export_and_keyword_only():
    assert sw.Config is Config
    with pytest.raises(TypeError):
        Config(())   # keyword-only


def test_frozen():
    c = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.every = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.nope = 3


def test_equality_and_pickle_roundtrip():
    c = Config.preset("fp8", every=5, role_every={"optim": 100})
    assert c == Config.preset("fp8", every=5, role_every={"optim": 100})
    assert pickle.loads(pickle.dumps(c)) == c       # configs travel to spawned ranks


# -- normalisation ----------------------------------------------------------------------------
@pytest.mark.parametrize("kw, field, expected", [
    ({"modules": "blocks.*"}, "modules", ("blocks.*",)),
    ({"modules": ["a", "b"]}, "modules", ("a", "b")),
    ({"exclude": "head"}, "exclude", ("head",)),
    ({"sinks": "jsonl"}, "sinks", sw.SinkConfig(use=("jsonl",))),
    ({"sinks": []}, "sinks", sw.SinkConfig(use=())),
    ({"module_types": nn.Linear}, "module_types", (nn.Linear,)),
    ({"module_types": ["Linear", nn.LayerNorm]}, "module_types", ("Linear", nn.LayerNorm)),
    ({"roles": "output"}, "roles", (Role.OUTPUT,)),
    ({"roles": ["grad", Role.WEIGHT]}, "roles", (Role.GRAD, Role.WEIGHT)),
    ({"backend": "torch"}, "backend", Backend.TORCH),
    ({"backend": Backend.TRITON}, "backend", Backend.TRITON),
    ({"formats": {"output": "E4M3"}}, "formats", {"output": "e4m3"}),
    ({"formats": {"grad*": Fmt.E5M2}}, "formats", {"grad*": "e5m2"}),
    ({"scales": {"output": 2}}, "scales", {"output": 2.0}),
    ({"role_every": {"optim": 100}}, "role_every", {"optim": 100}),
    ({"rank": 0}, "rank", 0),
    ({"every": 1, "warmup": 0, "shadow_every": 0}, "every", 1),
], ids=["modules-str", "modules-list", "exclude-str", "sinks-str", "sinks-empty",
        "module_types-class", "module_types-mixed", "roles-str", "roles-mixed", "backend-str",
        "backend-enum", "formats-uppercase", "formats-enum", "scales-int", "role_every",
        "rank-0", "minimal-cadence"])
def test_normalised(kw, field, expected):
    assert getattr(Config(**kw), field) == expected


def test_roles_are_enum_members():
    c = Config(roles=["output", "loss"])
    assert all(isinstance(r, Role) for r in c.roles)
    assert c.role_enabled(Role.OUTPUT) and not c.role_enabled(Role.GRAD)


def test_mappings_are_copied():
    fmts = {"output": "e4m3"}
    c = Config(formats=fmts)
    fmts["grad"] = "e5m2"
    assert c.formats == {"output": "e4m3"}


# -- validation -------------------------------------------------------------------------------
BAD = [
    # (id, kwargs, text the message must contain)
    ("every-0", {"every": 0}, "every"),
    ("every-negative", {"every": -1}, "every"),
    ("every-float", {"every": 2.0}, "every"),
    ("every-str", {"every": "10"}, "every"),
    ("every-bool", {"every": True}, "every"),
    ("every-none", {"every": None}, "every"),
    ("warmup-negative", {"warmup": -1}, "warmup"),
    ("warmup-bool", {"warmup": False}, "warmup"),
    ("shadow_every-negative", {"shadow_every": -2}, "shadow_every"),
    ("shadow_every-float", {"shadow_every": 0.5}, "shadow_every"),
    ("cooldown-negative", {"incidents": {"cooldown": -1}}, "incidents.cooldown"),
    ("min_numel-negative", {"range": {"min_numel": -5}}, "range.min_numel"),
    ("min_numel-bool", {"range": {"min_numel": True}}, "range.min_numel"),
    ("queue_size-0", {"sinks": {"queue_size": 0}}, "sinks.queue_size"),
    ("queue_size-str", {"sinks": {"queue_size": "big"}}, "sinks.queue_size"),
    ("rank-negative", {"rank": -1}, "rank"),
    ("rank-bool", {"rank": True}, "rank"),
    ("rank-str", {"rank": "0"}, "rank"),
    ("roles-unknown", {"roles": ["output", "activations"]}, "roles"),
    ("roles-int", {"roles": [3]}, "roles"),
    ("roles-not-list", {"roles": 5}, "roles"),
    ("roles-set", {"roles": {"output"}}, "roles"),
    ("backend-unknown", {"backend": "cuda"}, "backend"),
    ("backend-list", {"backend": ["torch"]}, "backend"),
    ("sinks-unknown", {"sinks": ["jsonl", "prometheus"]}, "sinks"),
    ("sinks-non-str", {"sinks": [1]}, "sinks"),
    ("modules-non-str", {"modules": ["a", 3]}, "modules"),
    ("modules-none", {"modules": None}, "modules"),
    ("exclude-non-str", {"exclude": [None]}, "exclude"),
    ("dashboard_stats-non-str", {"sinks": {"dashboard_stats": [1.0]}}, "sinks.dashboard_stats"),
    ("module_types-int", {"module_types": [3]}, "module_types"),
    ("module_types-instance", {"module_types": [nn.Linear(2, 2)]}, "module_types"),
    ("select-not-callable", {"select": "fc1"}, "select"),
    ("role_every-list", {"role_every": [("optim", 3)]}, "role_every"),
    ("role_every-int", {"role_every": 5}, "role_every"),
    ("role_every-unknown-role", {"role_every": {"activations": 3}}, "role_every"),
    ("role_every-0", {"role_every": {"optim": 0}}, "role_every"),
    ("role_every-bool", {"role_every": {"optim": True}}, "role_every"),
    ("role_every-float", {"role_every": {"optim": 2.5}}, "role_every"),
    ("formats-unknown", {"formats": {"output": "e3m4"}}, "formats"),
    ("formats-bf16-no-counts", {"formats": {"output": "bf16"}}, "formats"),
    ("formats-int-value", {"formats": {"output": 8}}, "formats"),
    ("formats-non-str-key", {"formats": {1: "e4m3"}}, "formats"),
    ("formats-list", {"formats": ["e4m3"]}, "formats"),
    ("scales-0", {"scales": {"output": 0}}, "scales"),
    ("scales-negative", {"scales": {"output": -2.0}}, "scales"),
    ("scales-nan", {"scales": {"output": float("nan")}}, "scales"),
    ("scales-inf", {"scales": {"output": float("inf")}}, "scales"),
    ("scales-str", {"scales": {"output": "2"}}, "scales"),
    ("scales-bool", {"scales": {"output": True}}, "scales"),
    ("scales-non-str-key", {"scales": {None: 2.0}}, "scales"),
    ("scales-not-mapping", {"scales": 2.0}, "scales"),
    ("overflow_warn-negative", {"range": {"overflow_warn": -0.1}}, "range.overflow_warn"),
    ("overflow_critical-above-1", {"range": {"overflow_critical": 1.5}},
     "range.overflow_critical"),
    ("underflow_warn-nan", {"range": {"underflow_warn": float("nan")}}, "range.underflow_warn"),
    ("underflow_critical-str", {"range": {"underflow_critical": "0.9"}},
     "range.underflow_critical"),
    ("underflow_critical-bool", {"range": {"underflow_critical": True}},
     "range.underflow_critical"),
    ("overflow-warn-above-critical", {"range": {"overflow_warn": 0.5, "overflow_critical": 0.1}},
     "range.overflow_warn"),
    ("underflow-warn-above-critical", {"range": {"underflow_warn": 0.95}}, "range.underflow_warn"),
    ("wandb_project-int", {"sinks": {"wandb_project": 5}}, "sinks.wandb_project"),
    ("wandb_project-empty", {"sinks": {"wandb_project": ""}}, "sinks.wandb_project"),
    ("drift-window-small", {"drift": {"window": 2}}, "drift.window"),
    ("drift-history-above-window", {"drift": {"window": 5}}, "drift.min_history"),
    ("spike-z-0", {"spike": {"z": 0}}, "spike.z"),
    ("shadow-dtype", {"shadow": {"dtype": "fp16"}}, "shadow.dtype"),
    ("capture-ring-0", {"capture": {"ring": 0}}, "capture.ring"),
    ("capture-snapshot", {"capture": {"snapshot": "evry"}}, "capture.snapshot.*did you mean"),
    ("dist-mode", {"dist": {"mode": "rank1"}}, "dist.mode"),
    ("guard-rerun-without-skip", {"guard": {"rerun_skipped": True}}, "guard.rerun_skipped"),
    ("skip-without-sentinel", {"guard": {"on_nonfinite": "skip"}, "sentinel": False},
     "sentinel"),
    ("update-window", {"update": {"window": 2}}, "update.window"),
    ("incidents-warn-above-critical", {"incidents": {"warn_bits": 11.0}}, "incidents.warn_bits"),
    ("drift-not-a-config", {"drift": 5}, "Config.drift must be a DriftConfig"),
    ("drift-other-config", {"drift": sw.SpikeConfig()}, "Config.drift must be a DriftConfig"),
    ("sinks-int", {"sinks": 3}, "Config.sinks must be a SinkConfig"),
]


@pytest.mark.parametrize("kw, needle", [(k, n) for _, k, n in BAD], ids=[i for i, _, _ in BAD])
def test_bad_value_raises_value_error_naming_field(kw, needle):
    with pytest.raises(ValueError, match=needle):
        Config(**kw)


@pytest.mark.parametrize("kw", [
    {"range": {"overflow_warn": 0.0, "overflow_critical": 0.0}},
    {"range": {"underflow_warn": 1.0, "underflow_critical": 1.0}},
    {"range": {"overflow_warn": 0, "overflow_critical": 1}},
    {"every": 1, "warmup": 0, "incidents": {"cooldown": 0}, "range": {"min_numel": 0},
     "sinks": {"queue_size": 1}},
    {"shadow_every": 3},
    {"rank": 7},
    {"sinks": list(SINK_NAMES)},
    {"select": lambda name, mod: True},
    {"scales": {"*": 1e-30, "grad": 1e30}},
], ids=["fractions-at-0", "fractions-at-1", "fractions-int", "int-minimums", "shadow-on",
        "rank-7", "all-sinks", "select-lambda", "scales-extreme-finite"])
def test_edge_values_accepted(kw):
    Config(**kw)


def test_replace_validates():
    c = Config(every=5)
    assert c.replace(every=7).every == 7 and c.every == 5
    with pytest.raises(ValueError, match="every"):
        c.replace(every=0)


def test_unknown_field_in_constructor_is_type_error():
    with pytest.raises(TypeError, match="nope"):
        Config(nope=1)


# -- presets ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PRESETS), ids=sorted(PRESETS))
def test_each_preset_builds(name):
    c = Config.preset(name)
    assert isinstance(c, Config) and PRESET_DOCS[name]
    for k, v in PRESETS[name].items():
        got = getattr(c, k)
        if k == "roles":
            assert got == tuple(Role(r) for r in v)
        elif k in SUBCONFIGS:
            for sub, x in v.items():
                got_sub = getattr(got, sub)
                assert getattr(got_sub, "value", got_sub) == x, f"{k}.{sub}"
        else:
            assert got == v


def test_presets_differ_from_each_other():
    built = {name: Config.preset(name) for name in PRESETS}
    assert len(set(built.values())) == len(built), "two presets build the same Config"
    assert built["bf16"].shadow_every > 0 and built["default"].shadow_every == 0
    assert built["bf16"].format_for("output") is None           # bf16 keeps fp32's range
    assert built["fp16"].format_for("grad") == "fp16"
    assert built["debug"].incidents.cooldown == 1
    assert built["debug"].capture.snapshot.value == "every"


def test_preset_fp8_formats():
    c = Config.preset("fp8")
    assert c.format_for("output") == "e4m3" and c.format_for("weight") == "e4m3"
    assert c.format_for("grad") == "e5m2" and c.format_for("grad_output") == "e5m2"
    assert c.format_for("loss") is None


def test_preset_full_reads_everything_every_step():
    c = Config.preset("full")
    assert c.every == 1 and set(c.roles) == set(Role)


@pytest.mark.parametrize("name", ["nope", "FP8", "", None, ["fp8"]],
                         ids=["unknown", "wrong-case", "empty", "none", "list"])
def test_unknown_preset(name):
    with pytest.raises(ValueError, match="preset"):
        Config.preset(name)


def test_preset_overrides_apply():
    c = Config.preset("fp8", every=3, formats={"output": "fp16"}, sinks=["jsonl"])
    assert c.every == 3 and c.formats == {"output": "fp16"} and c.sinks.use == ("jsonl",)
    c = Config.preset("debug", incidents={"warn_bits": 3.0})       # a mapping updates the preset's
    assert c.incidents.cooldown == 1 and c.incidents.warn_bits == 3.0
    c = Config.preset("debug", incidents=sw.IncidentConfig(warn_bits=3.0))   # an instance replaces
    assert c.incidents.cooldown == 50


def test_preset_override_validated():
    with pytest.raises(ValueError, match="every"):
        Config.preset("fp8", every=0)
    with pytest.raises(ValueError, match="nope"):
        Config.preset("fp8", nope=1)


def test_presets_table_not_mutated_by_use():
    before = json.dumps(PRESETS, default=str, sort_keys=True)
    Config.preset("fp8", formats={"output": "fp16"})
    Config.preset("debug", incidents={"cooldown": 3})
    with pytest.raises(TypeError):
        Config.preset("fp8").formats["grad"] = "fp16"     # a config's mapping is read-only
    assert json.dumps(PRESETS, default=str, sort_keys=True) == before


# -- from_dict --------------------------------------------------------------------------------
def test_from_dict_plain_and_preset():
    c = Config.from_dict({"every": 4, "roles": ["output", "loss"], "backend": "torch"})
    assert c.every == 4 and c.roles == (Role.OUTPUT, Role.LOSS) and c.backend is Backend.TORCH
    c = Config.from_dict({"preset": "fp8", "every": 2})
    assert c.every == 2 and c.format_for("grad") == "e5m2"
    assert Config.from_dict({}) == Config()
    assert Config.from_dict({"preset": None}) == Config()


def test_from_dict_does_not_mutate_input():
    d = {"preset": "fp8", "every": 2}
    Config.from_dict(d)
    assert d == {"preset": "fp8", "every": 2}


@pytest.mark.parametrize("data, needle", [
    ({"nope": 1}, "nope"),
    ({"every": 2, "evry": 3}, "evry"),
    ({"preset": "fp8", "nope": 1}, "nope"),
    ({1: 2}, "1"),
    ({"nope": 1, 2: 3}, "nope"),
    ({"preset": "turbo"}, "turbo"),
    ({"preset": ["fp8"]}, "preset"),
    ({"every": 0}, "every"),
    ("every=3", "mapping"),
    ([("every", 3)], "mapping"),
    (None, "mapping"),
], ids=["unknown-field", "typo", "unknown-with-preset", "int-key", "mixed-keys",
        "unknown-preset", "preset-list", "bad-value", "str", "list-of-pairs", "none"])
def test_from_dict_errors(data, needle):
    with pytest.raises(ValueError, match=needle):
        Config.from_dict(data)


# -- from_file --------------------------------------------------------------------------------
TOML_FLAT = """
preset = "fp8"
every = 5
roles = ["output", "grad", "loss"]
sinks = ["jsonl"]
[scales]
"grad*" = 1024.0
[role_every]
grad = 20
"""
TOML_TABLE = """
[tool.other]
x = 1

[stabilitywatch]
preset = "fp8"
modules = ["blocks.*"]
every = 5

[stabilitywatch.formats]
output = "fp16"
"""
YAML_FLAT = """
preset: fp8
every: 5
roles: [output, grad, loss]
sinks: [jsonl]
scales:
  "grad*": 1024.0
role_every:
  grad: 20
"""
YAML_TABLE = """
stabilitywatch:
  preset: fp8
  modules: ["blocks.*"]
  every: 5
  formats: {output: fp16}
"""
JSON_FLAT = json.dumps({"preset": "fp8", "every": 5, "roles": ["output", "grad", "loss"],
                        "sinks": ["jsonl"], "scales": {"grad*": 1024.0},
                        "role_every": {"grad": 20}})
JSON_TABLE = json.dumps({"stabilitywatch": {"preset": "fp8", "modules": ["blocks.*"],
                                            "every": 5, "formats": {"output": "fp16"}}})

FILES = [("toml", "cfg.toml", TOML_FLAT, TOML_TABLE),
         ("yaml", "cfg.yaml", YAML_FLAT, YAML_TABLE),
         ("yml", "cfg.yml", YAML_FLAT, YAML_TABLE),
         ("json", "cfg.json", JSON_FLAT, JSON_TABLE)]


def _needs_yaml(name):
    if name.endswith((".yaml", ".yml")):
        pytest.importorskip("yaml")


@pytest.mark.parametrize("name, text", [(n, f) for _, n, f, _ in FILES], ids=[i for i, *_ in FILES])
def test_from_file_flat_with_preset(tmp_path, name, text):
    _needs_yaml(name)
    p = tmp_path / name
    p.write_text(text)
    c = Config.from_file(p)
    assert c.every == 5
    assert c.roles == (Role.OUTPUT, Role.GRAD, Role.LOSS)
    assert c.sinks.use == ("jsonl",)
    assert c.format_for("output") == "e4m3" and c.format_for("grad") == "e5m2"   # from fp8
    assert c.scale_for("grad") == 1024.0 and c.scale_for("output") == 1.0
    assert c.role_every == {"grad": 20}
    assert Config.from_file(str(p)) == c                                         # str path too


@pytest.mark.parametrize("name, text", [(n, t) for _, n, _, t in FILES], ids=[i for i, *_ in FILES])
def test_from_file_stabilitywatch_table(tmp_path, name, text):
    _needs_yaml(name)
    p = tmp_path / name
    p.write_text(text)
    c = Config.from_file(p)
    assert c.every == 5 and c.modules == ("blocks.*",)
    assert c.formats == {"output": "fp16"}          # the file's table replaces the preset's


def test_from_file_uppercase_extension(tmp_path):
    p = tmp_path / "CFG.TOML"
    p.write_text("every = 3\n")
    assert Config.from_file(p).every == 3


@pytest.mark.parametrize("kind", ["missing", "directory"], ids=["missing", "directory"])
def test_from_file_unreadable(tmp_path, kind):
    p = tmp_path / "nope.toml" if kind == "missing" else tmp_path
    with pytest.raises(ValueError) as ei:
        Config.from_file(p)
    assert str(p) in str(ei.value)


MALFORMED = [
    ("toml-syntax", "bad.toml", "every = = 3\n"),
    ("toml-unclosed-table", "bad.toml", "[stabilitywatch\nevery = 3\n"),
    ("json-syntax", "bad.json", '{"every": 3,,}'),
    ("json-list-top", "bad.json", "[1, 2]"),
    ("json-empty", "bad.json", ""),
    ("yaml-syntax", "bad.yaml", "every: [3\n"),
    ("yaml-scalar-top", "bad.yaml", "just a string\n"),
    ("yaml-empty", "bad.yaml", ""),
    ("not-utf8", "bad.toml", b"\xff\xfe\x00every = 3"),
    ("unknown-field", "bad.toml", "evry = 3\n"),
    ("bad-value", "bad.json", '{"every": 0}'),
    ("bad-preset", "bad.toml", 'preset = "fp9"\n'),
    ("table-not-mapping", "bad.json", '{"stabilitywatch": 5}'),
]


@pytest.mark.parametrize("name, content", [(n, c) for _, n, c in MALFORMED],
                         ids=[i for i, _, _ in MALFORMED])
def test_from_file_malformed(tmp_path, name, content):
    _needs_yaml(name)
    p = tmp_path / name
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content)
    with pytest.raises(ValueError) as ei:
        Config.from_file(p)
    assert str(p) in str(ei.value)           # the message says which file


@pytest.mark.parametrize("name", ["cfg.ini", "cfg.txt", "cfg", "cfg.toml.bak"],
                         ids=["ini", "txt", "no-ext", "bak"])
def test_from_file_wrong_extension(tmp_path, name):
    p = tmp_path / name
    p.write_text("every = 3\n")
    with pytest.raises(ValueError, match=r"\.toml"):
        Config.from_file(p)


def test_from_file_unknown_field_named(tmp_path):
    p = tmp_path / "cfg.toml"
    p.write_text("[stabilitywatch]\nevery = 3\nshadow_evry = 2\n")
    with pytest.raises(ValueError, match="shadow_evry"):
        Config.from_file(p)


def test_from_file_accepts_pathlike(tmp_path):
    p = tmp_path / "cfg.json"
    p.write_text('{"every": 9}')

    class P(os.PathLike):
        def __fspath__(self):
            return str(p)

    assert Config.from_file(P()).every == 9


# -- glob lookups -----------------------------------------------------------------------------
@pytest.mark.parametrize("formats, role, expected", [
    ({"grad*": "e5m2"}, "grad.bias", "e5m2"),
    ({"grad*": "e5m2"}, "grad", "e5m2"),
    ({"grad*": "e5m2"}, "grad_output", "e5m2"),
    ({"grad*": "e5m2"}, "output", None),
    ({"output": "e4m3"}, "output", "e4m3"),
    ({"output": "e4m3"}, "grad_output", None),      # exact names are not substrings
    ({"*": "fp16", "output": "e4m3"}, "output", "e4m3"),    # exact name wins over a glob
    ({"*": "fp16", "output": "e4m3"}, "weight", "fp16"),
    ({"optim.*": "fp16"}, "optim.exp_avg_sq", "fp16"),
    ({"optim.*": "fp16"}, "optim", None),
    ({"Grad*": "e5m2"}, "grad", None),               # case-sensitive
    ({}, "output", None),
], ids=["glob-grad.bias", "glob-grad", "glob-grad_output", "glob-miss", "exact",
        "exact-not-substring", "exact-beats-glob", "star", "optim-state", "optim-bare",
        "case-sensitive", "empty"])
def test_format_for(formats, role, expected):
    assert Config(formats=formats).format_for(role) == expected


@pytest.mark.parametrize("scales, role, expected", [
    ({"grad*": 1024}, "grad.bias", 1024.0),
    ({"grad*": 1024}, "output", 1.0),
    ({"output": 0.5, "*": 2.0}, "output", 0.5),
    ({"output": 0.5, "*": 2.0}, "weight", 2.0),
    ({}, "weight", 1.0),
], ids=["glob", "default-1", "exact-beats-glob", "star", "empty"])
def test_scale_for(scales, role, expected):
    v = Config(scales=scales).scale_for(role)
    assert v == expected and isinstance(v, float)


# -- schedule ---------------------------------------------------------------------------------
def _sampled(cfg, role, steps=range(60)):
    s = Schedule(cfg)
    return [i for i in steps if role in s.roles_at(i)]


def test_schedule_loss_every_step():
    cfg = Config(every=7, warmup=0)
    assert _sampled(cfg, Role.LOSS) == list(range(60))


def test_schedule_warmup_then_every():
    cfg = Config(every=10, warmup=4)
    assert _sampled(cfg, Role.OUTPUT) == [0, 1, 2, 3, 10, 20, 30, 40, 50]


def test_schedule_warmup_covers_every():
    cfg = Config(every=10, warmup=15)
    assert _sampled(cfg, Role.GRAD, range(31)) == list(range(15)) + [20, 30]


@pytest.mark.parametrize("every", [1, 3, 16], ids=["every-1", "every-3", "every-16"])
def test_schedule_every_n(every):
    cfg = Config(every=every, warmup=0)
    assert _sampled(cfg, Role.WEIGHT) == [i for i in range(60) if i % every == 0]


def test_schedule_role_every_override():
    cfg = Config(every=5, warmup=2, role_every={"optim": 20, "loss": 7})
    s = Schedule(cfg)
    assert _sampled(cfg, Role.OPTIM) == [0, 1, 20, 40]
    assert _sampled(cfg, Role.OUTPUT) == [0, 1] + list(range(5, 60, 5))
    assert _sampled(cfg, Role.LOSS) == list(range(60))          # the loss ignores cadence
    assert s.roles_at(3) == frozenset({Role.LOSS})
    assert s.roles_at(20) == frozenset(cfg.roles)


def test_schedule_role_every_accepts_enum_keys():
    cfg = Config(every=5, warmup=0, role_every={Role.GRAD: 3})
    assert _sampled(cfg, Role.GRAD, range(10)) == [0, 3, 6, 9]


def test_schedule_only_enabled_roles():
    s = Schedule(Config(roles=["output"], every=1))
    assert s.roles_at(0) == frozenset({Role.OUTPUT})
    assert Role.INPUT not in Schedule(Config(every=1)).roles_at(0)
    assert Role.INPUT in Schedule(Config.preset("full")).roles_at(0)


def test_schedule_large_steps():
    s = Schedule(Config(every=1000, warmup=10))
    assert Role.OUTPUT in s.roles_at(41_000) and Role.OUTPUT not in s.roles_at(41_237)


# -- capture triggers: detectors and severities checked, with the closest match ----------------

@pytest.mark.parametrize("entry, needle", [
    ("critcal", "neither a severity .* nor a detector .*did you mean 'critical'\\?"),
    ("Critical", "did you mean 'critical'\\?"),
    ("warnign", "did you mean 'warning'\\?"),
    ("nonfinte", "did you mean 'nonfinite'\\?"),
    ("nonfinite:critcal", "severity must be one of .*did you mean 'critical'\\?"),
    ("ovreflow:warning", "unknown detector 'ovreflow'.*did you mean 'overflow'\\?"),
    ("range:warning", "unknown detector 'range'"),
    ("frobnicate", "'frobnicate' is neither"),
    (":warning", "unknown detector ''"),
    ("nonfinite:", "severity must be one of"),
], ids=["severity-typo", "severity-case", "warning-typo", "detector-typo", "pair-severity-typo",
        "pair-detector-typo", "internal-name", "unknown", "empty-detector", "empty-severity"])
def test_capture_trigger_typos_raise_with_a_suggestion(entry, needle):
    with pytest.raises(ValueError, match=needle):
        Config(capture=(entry,))


def test_capture_trigger_without_close_match_has_no_suggestion():
    with pytest.raises(ValueError) as ei:
        Config(capture=("frobnicate",))
    assert "did you mean" not in str(ei.value)


def test_capture_triggers_accept_every_detector_and_severity():
    from stabilitywatch.alert import DETECTORS
    from stabilitywatch.capture.policy import SEVERITIES, matches, triggers
    entries = list(SEVERITIES) + list(DETECTORS) + [f"{d}:{s}" for d in DETECTORS + ("*",)
                                                    for s in SEVERITIES]
    assert Config(capture=entries).capture.triggers == tuple(entries)
    trig = triggers(["critical", "overflow:warning"])
    assert matches(trig, "spike", "critical") and matches(trig, "overflow", "warning")
    assert not matches(trig, "spike", "warning") and not matches(trig, "overflow", "info")


def test_detector_names_list_holds_every_detector_the_package_emits():
    """alert.DETECTORS is the one list Config.capture is checked against: every `detector=` an
    Alert is built with in the package, and every Detector's `name`, must be in it."""
    import pathlib
    import re
    import stabilitywatch
    from stabilitywatch.alert import DETECTORS
    root = pathlib.Path(stabilitywatch.__file__).parent
    literal, named = set(), set()
    for path in root.rglob("*.py"):
        text = path.read_text()
        literal |= set(re.findall(r'detector="(\w+)"', text))
        if "detector=self.name" in text:
            named |= set(re.findall(r'^    name = "(\w+)"', text, re.M))
    assert {"overflow", "underflow"} <= literal and {"nonfinite", "drift", "divergence"} <= named
    assert (literal | named) - set(DETECTORS) == set()
