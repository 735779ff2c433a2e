"""Module selection: default (leaf modules that own parameters), globs, types, predicate,
exclude, errors on globs or types that match nothing and on selections that watch nothing,
named_modules() order."""
import pytest
import torch.nn as nn

from stabilitywatch.config import Config, Role
from stabilitywatch.hooks.selectors import select_modules


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.GELU()               # no parameters: not watched by default
        self.fc2 = nn.Linear(8, 4)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(4)
        self.mlp = MLP()
        self.drop = nn.Dropout(0.1)


class Scaled(nn.Module):
    """A non-leaf module that owns a parameter of its own, next to a child."""
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(nn.init.ones_(nn.Linear(1, 4).weight.new_empty(4)))
        self.inner = nn.Linear(4, 4)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        self.scaled = Scaled()
        self.head = nn.Linear(4, 10, bias=False)


DEFAULT = ["embed",
           "blocks.0.ln", "blocks.0.mlp.fc1", "blocks.0.mlp.fc2",
           "blocks.1.ln", "blocks.1.mlp.fc1", "blocks.1.mlp.fc2",
           "seq.0", "seq.2", "scaled.inner", "head"]


def names(model, **kw):
    return [n for n, _ in select_modules(model, Config(**kw))]


@pytest.fixture
def model():
    return Model()


def test_default_leaf_modules_with_parameters(model):
    assert names(model) == DEFAULT


def test_default_returns_the_module_objects(model):
    pairs = select_modules(model, Config())
    assert all(mod is model.get_submodule(n) for n, mod in pairs)


def test_default_skips_parameter_free_and_containers(model):
    got = set(names(model))
    for n in ("", "blocks", "blocks.0", "blocks.0.mlp", "blocks.0.mlp.act", "blocks.0.drop",
              "seq", "seq.1", "scaled"):
        assert n not in got


def test_default_leaf_with_only_buffers_not_selected():
    m = nn.Sequential(nn.BatchNorm1d(4, affine=False), nn.Linear(4, 4))
    assert names(m) == ["1"]


def test_default_single_leaf_model():
    m = nn.Linear(3, 3)
    assert names(m) == [""]


def test_default_parameter_free_model_is_an_error():
    with pytest.raises(ValueError, match="default.*watches no module.*'0', '1'.*ReLU, GELU"):
        names(nn.Sequential(nn.ReLU(), nn.GELU()))


@pytest.mark.parametrize("modules, expected", [
    (["blocks.*.mlp.fc1"], ["blocks.0.mlp.fc1", "blocks.1.mlp.fc1"]),
    (["*fc*"], ["blocks.0.mlp.fc1", "blocks.0.mlp.fc2", "blocks.1.mlp.fc1", "blocks.1.mlp.fc2"]),
    (["head"], ["head"]),
    (["blocks.1.mlp"], ["blocks.1.mlp"]),                          # a container, when asked
    (["blocks.0.mlp.*"], ["blocks.0.mlp.fc1", "blocks.0.mlp.act", "blocks.0.mlp.fc2"]),
    (["seq.[02]"], ["seq.0", "seq.2"]),
    (["head", "embed"], ["embed", "head"]),                        # model order, not pattern order
    (["*fc1", "blocks.0.*fc1"], ["blocks.0.mlp.fc1", "blocks.1.mlp.fc1"]),   # no duplicates
], ids=["fc1-of-every-block", "star-fc-star", "exact", "container", "children-incl-act",
        "char-class", "order-by-model", "overlap-no-dupes"])
def test_globs(model, modules, expected):
    assert names(model, modules=modules) == expected


def test_glob_is_case_sensitive(model):
    with pytest.raises(ValueError, match="HEAD"):
        names(model, modules=["HEAD"])


@pytest.mark.parametrize("modules, missing", [
    (["blocks.*.mlp.fc3"], "blocks.*.mlp.fc3"),
    (["head", "hed"], "hed"),
    (["layers.*"], "layers.*"),
], ids=["typo", "one-of-two", "other-naming"])
def test_glob_matching_nothing_raises(model, modules, missing):
    with pytest.raises(ValueError) as ei:
        names(model, modules=modules)
    msg = str(ei.value)
    assert missing in msg
    assert "blocks.0" in msg or "embed" in msg       # shows what names look like
    assert "\n" not in msg


@pytest.mark.parametrize("types, expected", [
    ([nn.LayerNorm], ["blocks.0.ln", "blocks.1.ln"]),
    (["LayerNorm"], ["blocks.0.ln", "blocks.1.ln"]),
    (["torch.nn.modules.normalization.LayerNorm"], ["blocks.0.ln", "blocks.1.ln"]),
    ([nn.Embedding, "GELU"], ["embed", "blocks.0.mlp.act", "blocks.1.mlp.act"]),
    (["MLP"], ["blocks.0.mlp", "blocks.1.mlp"]),                   # a user class by name
    ([MLP], ["blocks.0.mlp", "blocks.1.mlp"]),
    (["Module"], None),                                            # base class name: everything
], ids=["class", "class-name", "qualified-name", "class-and-name", "user-class-name",
        "user-class", "base-class-name"])
def test_module_types(model, types, expected):
    got = names(model, module_types=types)
    if expected is None:
        expected = [n for n, _ in model.named_modules()]
    assert got == expected


def test_module_types_subclass_by_name():
    class MyLinear(nn.Linear):
        pass

    m = nn.Sequential(MyLinear(2, 2), nn.Linear(2, 2))
    assert names(m, module_types=["Linear"]) == ["0", "1"]
    assert names(m, module_types=["MyLinear"]) == ["0"]
    assert names(m, module_types=[MyLinear]) == ["0"]


def test_select_predicate(model):
    got = names(model, select=lambda n, m: isinstance(m, nn.Linear) and n.startswith("seq"))
    assert got == ["seq.0", "seq.2"]


def test_select_predicate_receives_name_and_module(model):
    seen = []
    select_modules(model, Config(select=lambda n, m: seen.append((n, m)) or n == "head"))
    assert seen == list(model.named_modules())


def test_union_of_globs_types_and_predicate(model):
    got = names(model, modules=["head"], module_types=[nn.Embedding],
                select=lambda n, m: n == "seq.1")
    assert got == ["embed", "seq.1", "head"]


@pytest.mark.parametrize("kw, expected", [
    ({"exclude": ["head"]}, [n for n in DEFAULT if n != "head"]),
    ({"exclude": ["blocks.*"]}, ["embed", "seq.0", "seq.2", "scaled.inner", "head"]),
    ({"exclude": ["*.ln", "embed"]},
     ["blocks.0.mlp.fc1", "blocks.0.mlp.fc2", "blocks.1.mlp.fc1", "blocks.1.mlp.fc2",
      "seq.0", "seq.2", "scaled.inner", "head"]),
    ({"modules": ["*fc*"], "exclude": ["blocks.1.*"]}, ["blocks.0.mlp.fc1", "blocks.0.mlp.fc2"]),
    ({"module_types": [nn.Linear], "exclude": ["seq.*", "blocks.*"]}, ["scaled.inner", "head"]),
    ({"select": lambda n, m: n != "head", "exclude": ["*.*"]}, ["", "embed", "blocks", "seq",
                                                                "scaled"]),
    ({"exclude": ["nothing-like-this"]}, DEFAULT),                  # excluding nothing is fine
], ids=["default-minus-head", "default-minus-blocks", "two-patterns", "with-globs",
        "with-types", "with-predicate", "exclude-matches-nothing"])
def test_exclude(model, kw, expected):
    assert names(model, **kw) == expected


def test_exclude_does_not_call_predicate_on_excluded(model):
    seen = []
    select_modules(model, Config(select=lambda n, m: seen.append(n) or n == "head",
                                 exclude=["blocks*"]))
    assert seen and not any(n.startswith("blocks") for n in seen)


def test_order_follows_named_modules():
    class Odd(nn.Module):              # attribute order differs from alphabetical order
        def __init__(self):
            super().__init__()
            self.zeta = nn.Linear(2, 2)
            self.alpha = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
            self.mid = nn.Linear(2, 2)

    m = Odd()
    order = [n for n, _ in m.named_modules()]
    for kw in ({}, {"modules": ["*"]}, {"modules": ["mid", "alpha.*", "zeta"]},
               {"module_types": [nn.Linear]}, {"select": lambda n, mod: True}):
        got = names(m, **kw)
        assert got == [n for n in order if n in set(got)]
    assert names(m) == ["zeta", "alpha.0", "alpha.1", "mid"]


def test_shared_module_listed_once():
    shared = nn.Linear(3, 3)
    m = nn.Sequential(shared, nn.ReLU(), shared)
    assert names(m) == ["0"]            # named_modules() deduplicates; so does the selection


# -- selections that watch nothing, entries that match nothing ---------------------------------

@pytest.mark.parametrize("types, missing", [
    (["LayerNrom"], "LayerNrom"),                                  # a misspelt class name
    ([nn.Linear, "Conv2d"], "Conv2d"),                             # one of two
    ([nn.Conv2d], "Conv2d"),                                       # a class the model lacks
], ids=["typo", "one-of-two", "class"])
def test_module_type_matching_nothing_raises(model, types, missing):
    with pytest.raises(ValueError) as ei:
        names(model, module_types=types)
    msg = str(ei.value)
    assert f"module_types ['{missing}'] match no module" in msg
    assert ("did you mean 'LayerNorm'?" in msg) == (missing == "LayerNrom")
    assert "LayerNorm" in msg and "Linear" in msg                 # shows the model's types
    assert "\n" not in msg


def test_module_type_matching_only_excluded_modules_names_the_exclude(model):
    with pytest.raises(ValueError, match=r"exclude=\('\*\.ln',\).*watches no module"):
        names(model, module_types=["LayerNorm"], exclude=["*.ln"])


@pytest.mark.parametrize("kw, asked", [
    ({"exclude": ["*"]}, "exclude=('*',)"),
    ({"select": lambda n, m: False}, "select="),
    ({"modules": ["head"], "exclude": ["he*"]}, "modules=('head',), exclude=('he*',)"),
], ids=["exclude-everything", "select-never-true", "glob-then-excluded"])
def test_selection_of_no_module_raises(model, kw, asked):
    with pytest.raises(ValueError) as ei:
        names(model, **kw)
    msg = str(ei.value)
    assert "watches no module of the model" in msg and asked in msg
    assert "'embed'" in msg and "Embedding" in msg                # names and types to pick from
    assert "roles=('loss',)" in msg                                # how to ask for it on purpose
    assert "\n" not in msg


@pytest.mark.parametrize("kw", [{"exclude": ["*"]}, {"select": lambda n, m: False}],
                         ids=["exclude-everything", "select-never-true"])
def test_loss_only_config_may_select_nothing(model, kw):
    assert names(model, roles=(Role.LOSS,), **kw) == []
    assert names(nn.Sequential(nn.ReLU()), roles=("loss",)) == []
    with pytest.raises(ValueError, match="watches no module"):   # one module role: an error
        names(model, roles=(Role.LOSS, Role.WEIGHT), **kw)


def test_loss_only_config_still_refuses_typos(model):
    with pytest.raises(ValueError, match="hed"):
        names(model, roles=("loss",), modules=["hed"])
    with pytest.raises(ValueError, match="LayerNrom"):
        names(model, roles=("loss",), module_types=["LayerNrom"])
