"""The rank launcher (lightning_zero_offload/testing/ranks.py) checks every process's exit code, kills a hang at
its timeout, retries a rendezvous port another process took, and says which rank failed and why,
with its output's tail."""

import socket
import sys

import pytest
import torch
import torch.distributed as dist

from lightning_zero_offload.testing import ranks

pytestmark = pytest.mark.slow  # launches processes


def exit_on_rank_one(rank: int) -> int:
    """Rank 1 says why on stderr and exits with code 3 without a result."""
    import os

    if rank == 1:
        print("rank 1: giving up", file=sys.stderr, flush=True)
        os._exit(3)
    return rank


def sum_of_ranks(rank: int) -> dict:
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    return {"rank": rank, "world": dist.get_world_size(), "sum": total}


def raise_on_rank_zero(rank: int) -> None:
    import time

    if rank == 0:
        raise ValueError("rank 0 refuses")
    time.sleep(300)  # as a collective that waits for rank 0 forever: the launcher must not wait with it


def sleep_on_rank_one(rank: int) -> None:
    import time

    if rank == 1:
        time.sleep(300)


def test_results_come_back_by_rank_from_one_process_group(tmp_path):
    results = ranks.run_ranks(sum_of_ranks, 3, tmp_path)
    assert [r["rank"] for r in results] == [0, 1, 2] and all(r["world"] == 3 for r in results)
    assert all(torch.equal(r["sum"], torch.tensor([6.0])) for r in results)


def test_a_rank_that_exits_without_a_result_fails_with_its_exit_code_and_stderr(tmp_path):
    with pytest.raises(ranks.LaunchError, match=r"(?s)rank 1: exit code 3.*rank 1: giving up"):
        ranks.run_ranks(exit_on_rank_one, 2, tmp_path, timeout=60)


def test_a_rank_that_raises_fails_with_its_traceback_and_its_peer_is_not_waited_for(tmp_path):
    with pytest.raises(ranks.LaunchError) as error:
        ranks.run_ranks(raise_on_rank_zero, 2, tmp_path, timeout=120)
    message = str(error.value)
    assert "rank 0: exit code 1" in message and "ValueError: rank 0 refuses" in message
    assert "rank 1: still running 2 s after another process failed: killed" in message


def test_a_hang_is_killed_at_the_timeout(tmp_path):
    with pytest.raises(ranks.LaunchError, match="rank 1: still running after 5 s \\(a hang\\): killed"):
        ranks.run_ranks(sleep_on_rank_one, 2, tmp_path, timeout=5)


def test_a_rendezvous_port_taken_meanwhile_is_retried(monkeypatch):
    """Rank 0 binds MASTER_PORT as the rendezvous server does; the first port offered is held here."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    offered = iter([held.getsockname()[1], ranks.free_port()])
    monkeypatch.setattr(ranks, "free_port", lambda: next(offered))
    port = "('127.0.0.1', int(os.environ['MASTER_PORT']))"
    bind = f"import os, socket; os.environ['LOCAL_RANK'] == '0' and socket.socket().bind({port})"
    with held:
        exits = ranks.run_script_ranks([sys.executable, "-c", bind], world=2, timeout=60)
    assert [e.returncode for e in exits] == [0, 0], [e.output for e in exits]
