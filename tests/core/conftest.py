"""Core tests use tiny tensors: one intra-op thread avoids spinning threads fighting
over the shared 2-core machine (measured: 15 s -> 1.5 s for the hierarchy test).
Restored after each test so other test folders keep their thread count."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
