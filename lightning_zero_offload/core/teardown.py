"""The end of a run: release the process group and the engine after a failure, without a collective,
and destroy the process group before interpreter exit.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed as dist

from lightning_zero_offload.engine.infra.collectives import abandon_process_group
from lightning_zero_offload.warning import ZeroOffloadRuntimeWarning

if TYPE_CHECKING:
    from lightning_zero_offload.core.session import OffloadSession


def release_after_failure(session: OffloadSession | None, distributed: bool) -> None:
    """This rank failed: release the process group and the engine without a collective. Never raises.

    The other ranks may be blocked in a collective or already gone, so gathering anything now would
    hang. Tearing the process group down makes their pending collectives fail at once, so every rank
    exits within seconds instead of at the collective timeout. The group goes first: aborting NCCL also
    ends device work still waiting for a peer, which the engine's workers may be waiting for.
    """
    releases: list[Callable[[], None]] = [abandon_process_group] if distributed else []
    if session is not None:  # no gradient placeholder left on the user's module, the engine closed
        releases.append(lambda: session.close(after_failure=True))
    for release in releases:
        try:
            release()
        except Exception as error:  # noqa: BLE001 -- the caller would report this error instead of the real one
            warnings.warn(
                f"zero_offload: cleaning up after the failure also failed: {error!r}",
                ZeroOffloadRuntimeWarning,
                stacklevel=2,
            )


def release_process_group() -> None:
    """Destroy the process group, then collect garbage while the interpreter is fully alive.

    A gloo group still referenced from a reference cycle (Lightning's trainer, strategy and module form
    many) would otherwise be destroyed during interpreter finalization, which can abort the process
    (docs/benchmarks.md, "Exit with a gloo group"). Registered with ``atexit`` by both front ends.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
