"""The snapshot ring's automatic target counts optimizer state that does not exist yet."""
import torch

from stabilitywatch.capture.snapshot import Snapshotter, _model_tensors


def test_state_to_come_before_and_after_the_first_step():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.AdamW(model.parameters())
    snap = Snapshotter(model, opt)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert snap._state_to_come(_model_tensors(model)) == 2 * params  # buffers not counted
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert snap._state_to_come(_model_tensors(model)) == 0  # the state exists: counted as is
    assert Snapshotter(model, None)._state_to_come(_model_tensors(model)) == 0
    snap.close()
