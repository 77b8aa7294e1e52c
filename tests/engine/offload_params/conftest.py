import pytest
from offload_params_helpers import one_rank_group


@pytest.fixture(scope="module")
def mesh():
    """A one-rank gloo group and its CPU mesh for the module's tests, destroyed after them (other tests
    expect no process group)."""
    with one_rank_group() as mesh:
        yield mesh
