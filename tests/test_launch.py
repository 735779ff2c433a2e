"""kernels/launch.FastLaunch with a stand-in for a @triton.jit function (the real launcher needs
a GPU: tests/test_kernel_gpu.py runs it there). What the direct path must get right: the same
arguments in the same order as Triton's own launch, a new compile for each specialization, and
a fall-back to Triton's launcher when the compiled launcher refuses the call."""
import logging

import pytest
import torch

from stabilitywatch.kernels.launch import FastLaunch


class FakeKernel:
    def __init__(self, fail=False):
        self.calls, self.fail = [], fail
        self.function, self.packed_metadata = "fn", "md"

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *a):
        if self.fail:
            raise TypeError("launcher takes other arguments")
        self.calls.append(a)


class FakeJit:
    arg_names = ["x_ptr", "out_ptr", "n", "A", "B"]

    def __init__(self, fail=False):
        self.compiles, self.fail, self.kernels = [], fail, []

    def __getitem__(self, grid):
        def launch(*args, num_warps, **consts):
            self.compiles.append((grid, args, consts, num_warps))
            k = FakeKernel(self.fail)
            self.kernels.append(k)
            return k
        return launch


DEVICE = [0]


@pytest.fixture(autouse=True)
def fake_cuda(monkeypatch):
    DEVICE[0] = 0
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: 1234 + dev,
                        raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: DEVICE[0])


def test_second_launch_goes_straight_to_the_compiled_launcher():
    jit = FakeJit()
    fl = FastLaunch(jit)
    x, out = torch.zeros(64), torch.zeros(8, dtype=torch.float64)
    fl(3, (x, out, 64), {"A": 1, "B": True}, 4)
    fl(5, (x, out, 99), {"A": 1, "B": True}, 4)
    assert len(jit.compiles) == 1
    (call,) = jit.kernels[0].calls
    assert call[:4] == (5, 1, 1, 1234)                   # grid, then the current stream
    assert call[4:6] == ("fn", "md")
    assert call[9:] == (x, out, 99, 1, True)             # runtime args, then constexprs in order


def test_each_specialization_compiles_once():
    jit = FakeJit()
    fl = FastLaunch(jit)
    out = torch.zeros(8, dtype=torch.float64)
    buf = torch.zeros(65)
    for x in (buf[:64], buf[1:], buf[:64].double(), buf[:64]):  # aligned, unaligned, dtype, again
        fl(1, (x, out, 10), {"A": 1, "B": True}, 4)
    fl(1, (buf[:64], out, 2**40), {"A": 1, "B": True}, 4)   # an int past int32
    fl(1, (buf[:64], out, 10), {"A": 2, "B": True}, 4)      # another constexpr
    fl(1, (buf[:64], out, 10), {"A": 1, "B": True}, 8)      # other warps
    DEVICE[0] = 1
    fl(1, (buf[:64], out, 10), {"A": 1, "B": True}, 4)      # another current device
    fl(1, (buf[:64], out, 10), {"A": 1, "B": True}, 4)
    assert len(jit.compiles) == 7
    assert jit.kernels[-1].calls[0][3] == 1235              # that device's stream


def test_a_refusing_launcher_switches_the_direct_path_off(caplog):
    jit = FakeJit(fail=True)
    fl = FastLaunch(jit)
    x, out = torch.zeros(64), torch.zeros(8, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
        for _ in range(3):
            fl(1, (x, out, 64), {"A": 1, "B": True}, 4)
    assert not fl.on
    assert len(jit.compiles) == 3          # every launch still happened, through Triton
    assert sum("direct kernel launch failed" in r.message for r in caplog.records) == 1


def test_constexprs_out_of_order_are_never_replayed():
    jit = FakeJit()
    fl = FastLaunch(jit)
    x, out = torch.zeros(64), torch.zeros(8, dtype=torch.float64)
    fl(1, (x, out, 64), {"B": True, "A": 1}, 4)
    fl(1, (x, out, 64), {"B": True, "A": 1}, 4)
    assert not fl.on and len(jit.compiles) == 2


def test_two_dimensional_grid_and_compile_options_reach_the_launcher():
    jit = FakeJit()
    fl = FastLaunch(jit)
    x, out = torch.zeros(64), torch.zeros(8, dtype=torch.float64)
    fl((3, 2), (x, out, 64), {"A": 1, "B": True}, 4, maxnreg=96)
    fl((7, 5), (x, out, 64), {"A": 1, "B": True}, 4, maxnreg=96)
    fl((7, 5), (x, out, 64), {"A": 1, "B": True}, 4)        # no cap: another specialization
    assert [c[0] for c in jit.compiles] == [(3, 2, 1), (7, 5, 1)]
    assert jit.kernels[0].calls[0][:3] == (7, 5, 1)


def test_empty_hook_chains_are_passed_as_none(monkeypatch):
    # triton 3.6 keeps empty HookChains in knobs: passing None skips launch_metadata
    from stabilitywatch.kernels import launch

    class Chain:
        def __init__(self, calls):
            self.calls = calls

    class Knobs:
        class runtime:
            launch_enter_hook = Chain([])
            launch_exit_hook = Chain([print])

    monkeypatch.setattr(launch, "_knobs", Knobs)
    enter, leave = launch._hooks()
    assert enter is None and leave is Knobs.runtime.launch_exit_hook


@pytest.mark.parametrize("tile", [1024, 2048])
@pytest.mark.parametrize("tiles", [1, 131, 5000, 2**20, 2**21 + 7, 2**24])
def test_tile_programs_keep_packed_counts_under_16_bits(tile, tiles):
    # lane L of every warp adds to one packed 16-bit count per bin: a program may give it at most
    # 65535 values, whatever the tensor's size (values all in one bin: an all-zero tensor)
    from stabilitywatch.kernels.tuning import tile_programs
    progs = min(tiles, tile_programs(tiles, tile, sms=132))
    assert -(-tiles // progs) * (tile // 32) <= 65535
    if tiles >= 132 * 8:
        assert progs >= 132


def test_bound_launches_replay_with_fixed_constexprs():
    jit = FakeJit()
    fl = FastLaunch(jit)
    bound = fl.bind({"A": 1, "B": True}, 4, maxnreg=96)
    buf, out = torch.zeros(65), torch.zeros(8, dtype=torch.float64)
    a = buf[:64]
    bound(3, (a, out, 64))
    bound(5, (a, out, 99))
    bound(6, (buf[1:], out, 64))                   # unaligned: another specialization
    fl(7, (a, out, 64), {"A": 1, "B": True}, 4, maxnreg=96)  # shares FastLaunch's cache
    DEVICE[0] = 1
    bound(2, (a, out, 64))                  # another current device
    assert len(jit.compiles) == 3
    assert [c[:4] for c in jit.kernels[0].calls] == [(5, 1, 1, 1234), (7, 1, 1, 1234)]
    assert jit.kernels[0].calls[0][9:] == (a, out, 99, 1, True)
    assert jit.compiles[1][2] == {"A": 1, "B": True, "maxnreg": 96}
    assert jit.kernels[2].calls == [] and jit.compiles[2][0] == (2, 1, 1)


def test_a_refusing_launcher_switches_bound_launches_off(caplog):
    jit = FakeJit()
    fl = FastLaunch(jit)
    bound = fl.bind({"A": 1, "B": True}, 4)
    x, out = torch.zeros(64), torch.zeros(8, dtype=torch.float64)
    bound(1, (x, out, 64))
    jit.kernels[0].fail = True  # e.g. another Triton's launcher
    with caplog.at_level(logging.WARNING, logger="stabilitywatch"):
        bound(1, (x, out, 64))
        bound(1, (x, out, 64))
    assert not fl.on and len(jit.compiles) == 3   # each launch still happened, through Triton
    assert sum("direct kernel launch failed" in r.message for r in caplog.records) == 1
