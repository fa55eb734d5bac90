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


# the speculative tests' target, a mostly wrong draft and an untrained MTP head for it
@pytest.fixture(scope="module")
def target_dir(checkpoint_root):
    return make_checkpoint("llama_gqa_untied", checkpoint_root)


@pytest.fixture(scope="module")
def other_draft_dir(checkpoint_root):
    """A different random model with the same vocabulary: a draft that is mostly wrong."""
    return make_checkpoint("llama3_rope_tied", checkpoint_root)


@pytest.fixture(scope="module")
def random_mtp_dir(target_dir, checkpoint_root):
    from tandem.backends.models import load_model
    from tandem.backends.models.mtp import MTPHead, save_mtp_head
    out = checkpoint_root / "random_mtp"
    if not out.exists():
        torch.manual_seed(3)
        save_mtp_head(MTPHead(load_model(target_dir).config), out, torch.float32)
    return out
