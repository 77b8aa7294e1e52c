import os
import sys

import pytest
import torch

# Test helpers (tests/helpers.py) are plain modules next to the tests; with --import-mode=importlib the
# tests directory is not on sys.path by itself.
sys.path.insert(0, os.path.dirname(__file__))

# The tests never reach the Hugging Face hub (CI has no network): a hub id looked up online there retries for
# about 23 s before it fails. Subprocesses inherit the variable; huggingface_hub reads it once, at its import,
# which pyproject's filterwarnings has already caused (the package -> Lightning -> torchmetrics -> transformers).
os.environ["HF_HUB_OFFLINE"] = "1"
if (hub := sys.modules.get("huggingface_hub")) is not None:
    hub.constants.HF_HUB_OFFLINE = True


@pytest.fixture(scope="module")
def one_torch_thread():
    """Reference torch ops on one thread: on a busy shared machine, OpenMP barriers waiting for a
    descheduled thread made them 10x slower. (The kernels take their thread count per call.)"""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def torch_seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def own_process_group():
    """The one-process group a strategy with offload_params=True starts for FSDP2 lives until exit (a later fit
    reuses it); with this fixture it ends with the test, so later tests do not run in a 'distributed setting'."""
    yield
    from lightning_zero_offload.core import release_process_group

    release_process_group()


@pytest.fixture
def backend(request: pytest.FixtureRequest):
    """Every kernel backend in turn (parametrized in pytest_generate_tests), restored afterwards."""
    from lightning_zero_offload import kernels

    previous = kernels.backend()
    kernels.set_backend(request.param)
    yield request.param
    kernels.set_backend(previous)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        from lightning_zero_offload import kernels

        metafunc.parametrize("backend", kernels.available_backends(), indirect=True)
