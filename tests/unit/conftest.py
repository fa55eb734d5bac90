import pytest
import torch

# one thread: the tests share two cores with each other's servers and with training runs,
# and oversubscribed torch threads slow everything down many times over
torch.set_num_threads(1)

from .tiny_checkpoints import ARCHS, make_checkpoint


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session", params=ARCHS)
def tiny_checkpoint(request, checkpoint_root):
    return make_checkpoint(request.param, checkpoint_root)
