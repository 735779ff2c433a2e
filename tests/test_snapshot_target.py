"""The snapshot ring's automatic target counts optimizer state that does not exist yet (GPU
parameters only; tests/test_capture_gpu.py checks where the ring goes)."""
import torch

from stabilitywatch.capture.snapshot import Snapshotter, _trained


def test_the_state_to_come_is_for_trained_float_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 2))
    model[2].weight.requires_grad_(False)  # frozen: no state will come for it
    opt = torch.optim.AdamW(model.parameters())
    got = {id(p) for p in _trained(opt)}
    want = {id(p) for p in model.parameters() if p.requires_grad}
    assert got == want and id(model[2].weight) not in got
    assert Snapshotter(model, opt)._state_to_come() == 0  # CPU parameters: not the device's


def test_no_state_to_come_after_the_first_step_even_for_a_stateless_optimizer():
    model = torch.nn.Linear(4, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # momentum 0: never any state
    snap = Snapshotter(model, opt)
    assert not snap._stepped
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert snap._stepped and not any(opt.state.values())
    assert Snapshotter(model, None)._state_to_come() == 0
    snap.close()
