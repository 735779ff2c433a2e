"""What an unsampled step costs the training thread: in eager mode the watched modules carry no
forward hook of the monitor's on steps that read no forward role (a module with any forward
hook leaves nn.Module's fast call path), the hooks come back for the steps that do, in their
place among the user's own, and a torch.compile'd model keeps them (adding and removing hooks
would change what dynamo guards on)."""
import json

import numpy as np
import torch
import torch.nn as nn

import stabilitywatch as sw


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _train(model, mon, steps, fwd=None, seen=None):
    opt = mon.optimizer
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(4, 8, generator=g)
        with mon.step(step, batch=x):
            if seen is not None:
                seen[step] = {n: list(m._forward_hooks.values()) for n, m in mon.modules}
            loss = (fwd or model)(x).square().mean()
            loss.backward()
            mon.observe_loss(loss)
            opt.step()
            opt.zero_grad()


def _rows(path):
    return {(r["step"], r["module"], r["tensor"]): r["stats"]
            for r in map(json.loads, open(path / "stats.jsonl"))}


def test_unsampled_eager_steps_carry_no_forward_hooks_and_rows_stay_the_same(tmp_path):
    cfg = sw.Config(every=3, warmup=0, sinks=("jsonl",))
    model = _model()
    seen = {}
    with sw.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg,
                  run_dir=tmp_path / "a") as mon:
        _train(model, mon, 7, seen=seen)
    hooks = {step: sum(len(v) for v in per.values()) for step, per in seen.items()}
    assert hooks == {s: (len(mon.modules) if s % 3 == 0 else 0) for s in range(7)}, hooks
    # the same run with the hooks left registered on every step gives the same rows
    model = _model()
    with sw.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg,
                  run_dir=tmp_path / "b") as kept:
        kept.taps.keep_forward = True
        _train(model, kept, 7)
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert a.keys() == b.keys() and any(k[2] == "output" and k[0] == 6 for k in a)
    assert a == b


def test_the_users_own_forward_hooks_keep_their_place(tmp_path):
    model = _model()
    first = model[0]
    before = lambda m, a, out: out * 2     # noqa: E731  registered before watch(): runs first
    after = lambda m, a, out: out * 3      # noqa: E731  registered after: runs after ours
    first.register_forward_hook(before)
    cfg = sw.Config(every=2, warmup=0, sinks=("jsonl",))
    seen = {}
    with sw.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg,
                  run_dir=tmp_path) as mon:
        first.register_forward_hook(after)
        _train(model, mon, 5, seen=seen)
    for step in range(5):
        hooks = seen[step]["0"]
        if step % 2:
            assert hooks == [before, after], step
        else:   # the monitor's between them, where it was registered
            assert len(hooks) == 3 and hooks[0] is before and hooks[2] is after, step
    # the monitor reads the output as it is after `before` and before `after`
    rows = _rows(tmp_path)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 8, generator=g) for _ in range(5)]
    with torch.no_grad():   # step 0 runs on the initial weights
        out0 = _model()[0](xs[0]) * 2
    for step in (0, 2, 4):   # hooks registered at watch(), then registered again
        assert (step, "0", "output") in rows
    assert np.isclose(rows[(0, "0", "output")]["absmax"], out0.abs().max().item(), rtol=1e-6)


def test_a_compiled_model_keeps_its_forward_hooks(tmp_path):
    cfg = sw.Config(every=2, warmup=0, sinks=())
    torch._dynamo.reset()
    model = _model()
    fwd = torch.compile(model, backend="eager")
    with sw.watch(fwd, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg,
                  run_dir=tmp_path / "wrapper") as mon:   # known compiled at watch()
        assert mon.taps.keep_forward
    seen = {}
    with sw.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg,
                  run_dir=tmp_path / "compiled") as mon:  # seen compiled at its first trace
        _train(model, mon, 4, fwd=fwd, seen=seen)
    assert [sum(len(v) for v in seen[s].values()) for s in range(4)] == [2] * 4
    model = _model()   # the same loop in eager mode drops them on its unsampled steps
    seen = {}
    with sw.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg,
                  run_dir=tmp_path / "eager") as mon:
        _train(model, mon, 4, seen=seen)
    assert [sum(len(v) for v in seen[s].values()) for s in range(4)] == [2, 0, 2, 0]


def _same_numpy_state(a, b):
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and tuple(a[2:]) == tuple(b[2:])


def test_rng_states_read_numpy_in_full_only_when_it_can_have_changed(monkeypatch):
    import random
    from stabilitywatch.capture import rng as rng_mod
    full = []
    get_state = np.random.get_state

    def counted(*a, **k):
        full.append(1)
        return get_state(*a, **k)
    np.random.seed(5)
    reader = rng_mod.RngStates()
    monkeypatch.setattr(rng_mod.np.random, "get_state", counted)
    moves = [lambda: None, lambda: None, lambda: np.random.rand(3),
             lambda: np.random.standard_normal(),   # draws a pair, keeps one: has_gauss
             lambda: None,
             lambda: np.random.standard_normal(),   # takes the kept one: the words stay
             lambda: None, lambda: np.random.seed(5), lambda: None,
             lambda: random.random(), lambda: torch.rand(2)]
    reads = []
    for move in moves:
        move()
        st = reader.read()
        want = get_state()
        assert _same_numpy_state(st["numpy"], want)
        assert st["python"] == random.getstate() and torch.equal(st["torch"], torch.get_rng_state())
        reads.append(len(full))
    # full reads: the first, after rand, after each normal draw, the one after the cached
    # Gaussian was read (has_gauss), after the seed; none where nothing moved
    assert reads == [1, 1, 2, 3, 4, 5, 5, 6, 6, 6, 6], reads


def test_rng_states_read_python_in_full_only_when_it_can_have_changed():
    import random
    from stabilitywatch.capture import rng as rng_mod
    random.seed(7)
    kept = {}
    reader = rng_mod.RngStates()
    last = reader.read()["python"]
    assert reader._py_src[2] is not None   # CPython's layout: the words are read in place
    moves = [lambda: None, lambda: None, lambda: random.random(),
             lambda: kept.update(g=(random.gauss(0, 1), random.getstate())),   # keeps one
             lambda: None,
             lambda: random.gauss(0, 1),     # takes the kept one: the words stay
             lambda: None,
             lambda: random.setstate(kept["g"][1]),   # the same words, a Gaussian kept again
             lambda: random.seed(7), lambda: None,
             lambda: random.setstate(random.getstate()),  # the same state: nothing moved
             lambda: np.random.rand(2), lambda: torch.rand(2)]
    reads, full = [], 0
    for move in moves:
        move()
        st = reader.read()["python"]
        assert st == random.getstate()
        full += st is not last   # a full read makes a new state; an unchanged one is kept
        last = st
        reads.append(full)
    # full reads: after the draw, after each gauss (the second only moves gauss_next), after
    # the setstate that keeps a Gaussian again (the words as they were), after the seed; none
    # where nothing moved
    assert reads == [0, 0, 1, 2, 2, 3, 3, 4, 5, 5, 5, 5, 5], reads


def test_frames_whose_copies_landed_are_read_without_a_wait_call(tmp_path, monkeypatch):
    """At a step end the frames are polled: an event that completed needs no synchronize (on
    CUDA an API call per copy and per step); only close() waits."""
    from stabilitywatch.stats import staging
    waits = []
    wait = staging.Pending.wait
    monkeypatch.setattr(staging.Pending, "wait", lambda self: (waits.append(self.step),
                                                               wait(self))[1])
    model = _model()
    mon = sw.watch(model, torch.optim.SGD(model.parameters(), lr=0.1),
                   config=sw.Config(every=2, warmup=0, sinks=()), run_dir=tmp_path)
    _train(model, mon, 4)
    assert mon.frames_seen == 4 and waits == []
    mon.close()
