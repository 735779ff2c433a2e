import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    # tiny models: one thread is fastest, and CI's 2 cores are shared with other jobs
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
