import pytest
from kernel_helpers import NATIVE

from lightning_zero_offload import kernels


@pytest.fixture(params=NATIVE)
def native(request: pytest.FixtureRequest):
    """Every native backend in turn, restored afterwards."""
    previous = kernels.backend()
    kernels.set_backend(request.param)
    yield request.param
    kernels.set_backend(previous)
