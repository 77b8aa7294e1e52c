"""The sharded checkpoint format: versioned, published by its metadata, every shard checked on load.

```
epoch=3-step=400.ckpt/          never removed or renamed while a checkpoint lives there
  v000007/                      one directory per save, a fresh name each time
    shard_00000.pt              rank r: its flat master, exp_avg and exp_avg_sq (1/world of each; fp32 or bf16;
                                without optimizer state in the checkpoint, the master alone); with a device
                                share each in two: "<name>" the host's part, "<name>@device" the share's
    shard_00001.pt
    meta.pt                     rank 0, written last: the Lightning checkpoint minus the sharded tensors (frozen
                                parameters' optimizer state stays in it, whole), plus the layout, the save id
                                and each shard's size and CRC-32
```

The checkpoint is the newest version directory that has a ``meta.pt``. A save creates a new version,
writes the shards, then ``meta.pt`` (atomically: a rename on the local disk, one object remotely), and
only then deletes the older versions, so a crash at any point leaves a complete checkpoint under the
same path, and the next save deletes what the crash left; a save that fails with an error deletes its
own unpublished version at once. A first save to a path that dies leaves no complete version: loading
names it as an interrupted save. A save refuses a directory that holds anything else than versions (it
would delete it on publishing). Each shard records the save id, and ``meta.pt`` its size and
checksum, so a shard from another save, an edited or a truncated one is named on load instead of being
mixed in. ``meta.pt`` itself is checked against the CRC-32 that the zip format stores with each of its
records (torch writes them, and never reads them), so every file is checked, in checkpoints of every
release.
"""

from __future__ import annotations

import contextlib
import re
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from lightning_zero_offload.checkpoints.assemble import assemble_params
from lightning_zero_offload.checkpoints.distributed_files import DCP_METADATA
from lightning_zero_offload.checkpoints.files import (
    CheckpointError,
    Location,
    PathLike,
    check_zip_checksums,
    file_record,
    file_size,
    load_file,
    remove_stale_temporaries,
    save_file,
)
from lightning_zero_offload.checkpoints.keys import FORMAT_KEY
from lightning_zero_offload.checkpoints.writer import DeviceTensors, FileRecord
from lightning_zero_offload.engine.step.cpu_state import DEVICE_PART

if TYPE_CHECKING:
    from lightning_zero_offload.engine.step.layout import Layout

META_FILE = "meta.pt"
SHARD_KEYS = ("master", "exp_avg", "exp_avg_sq")
_VERSION = re.compile(r"^v(\d{6,})$")


def shard_file(rank: int) -> str:
    return f"shard_{rank:05d}.pt"


def layout_checksum(info: dict[str, Any]) -> int:
    """CRC-32 of the layout as saved: an edited ``meta.pt`` no longer matches it."""
    fields = {k: v for k, v in info.items() if k != "layout_crc32"}
    return zlib.crc32(repr(fields).encode())


def _versions(path: Location) -> list[tuple[int, str]]:
    found = [(int(m.group(1)), name) for name in path.children() if (m := _VERSION.match(name))]
    return sorted(found, reverse=True)


def current_version(path: PathLike | Location) -> Location | None:
    """The directory holding the checkpoint at ``path``: its newest complete version (or a version-1 layout)."""
    path = path if isinstance(path, Location) else Location.of(path)
    for _, name in _versions(path):
        if (path / name / META_FILE).is_file():
            return path / name
    if (path / META_FILE).is_file():
        return path  # written before versioned directories: meta.pt and shards directly inside
    return None


def is_sharded_checkpoint(path: PathLike) -> bool:
    """Whether ``path`` is a sharded checkpoint directory: complete, or left by an interrupted save (which
    :func:`load_sharded` then names, instead of calling it a directory given by mistake)."""
    return directory_kind(Location.of(path)) in ("sharded", "interrupted")


DirectoryKind = Literal["not a directory", "sharded", "interrupted", "empty", "other"]


def directory_kind(path: Location) -> DirectoryKind:
    """What ``path`` is, for the checks and errors of a save or load there: ``"sharded"`` (holds a complete
    version), ``"interrupted"`` (only versions without ``meta.pt``: a save that never finished), ``"empty"``,
    ``"other"`` (a directory holding anything else), or ``"not a directory"`` (a file, or nothing)."""
    if not path.is_dir():
        return "not a directory"
    if current_version(path) is not None:
        return "sharded"
    if _incomplete_versions(path):
        return "interrupted"
    return "other" if path.children() else "empty"


def _incomplete_versions(path: Location) -> list[str]:
    """Version directories (or, in the version-1 layout, shards) of saves that never wrote ``meta.pt``."""
    return [name for _, name in _versions(path)] or [n for n in path.children() if n.startswith("shard_")]


def sharded_layout(
    layout: Layout, keys: list[list[str]], steps: Sequence[int], torch_index: Sequence[int]
) -> dict[str, Any]:
    """What a loader needs to reassemble full tensors from the shards, at any world size: each trainable
    parameter's state-dict ``keys``, shape, place in its first bucket (a split parameter runs on into the next
    ones), step count and optimizer-state number."""
    return {
        "format": "sharded",
        "version": 2,
        "world_size": layout.world_size,
        "buckets": [{"shard_start": b.shard_start, "shard_numel": b.shard_numel} for b in layout.buckets],
        "params": [
            {
                "keys": keys[slot.index],
                "shape": list(slot.shape),
                "bucket": slot.bucket,
                "offset": slot.bucket_offset,
                "step": steps[slot.index],
                "torch_index": torch_index[slot.index],
            }
            for slot in layout.slots
        ],
    }


def save_sharded(
    path: PathLike,
    shard: dict[str, torch.Tensor],
    meta: dict[str, Any] | None,
    rank: int,
    broadcast: Callable[[Any], Any],
    gather: Callable[[Any], list[Any]],
) -> None:
    """Write this rank's ``shard`` (and on rank 0 ``meta``, whose ``FORMAT_KEY`` layout gets completed here).

    ``broadcast`` sends rank 0's object to all ranks and ``gather`` gives every rank the list of all
    ranks' objects: the caller's collectives, trivial with one rank. A failure on any rank (a full disk,
    say) is passed through them, so every rank raises it instead of waiting for the failed one.
    """
    root = Location.of(path)
    started = attempt(_begin, root, meta) if rank == 0 else None
    version_name, save_id, names = raise_any([broadcast(started)])[0]
    version = root / version_name
    shard = {name: shard[name] for key in names for name in (key, key + DEVICE_PART) if name in shard}
    on_device = DeviceTensors(shard)  # the device share's parts reach the host one at a time, as they are written
    contents = on_device.placed({**shard, "save_id": save_id, "rank": rank})
    streamed = on_device if on_device.placeholders else None
    with removed_unless_published(version, rank):
        records = raise_any(gather(attempt(save_file, contents, version / shard_file(rank), True, streamed)))
        if rank == 0:
            assert meta is not None
            info = meta[FORMAT_KEY]
            info.update(save_id=save_id, shards=[{"size": r.size, "crc32": r.crc32} for r in records])
            info["layout_crc32"] = layout_checksum(info)
        publish(meta, root, version_name, rank, broadcast)


@contextlib.contextmanager
def removed_unless_published(version: Location, rank: int) -> Iterator[None]:
    """Around a save's writes and :func:`publish`, whose collectives have returned on every rank when anything
    in it raises: rank 0 then deletes what this save wrote, unless meta.pt is in place already, which makes
    the new version the checkpoint."""
    try:
        yield
    except BaseException:
        if rank == 0 and not (version / META_FILE).is_file():
            remove_unpublished(version)
        raise


def publish(
    meta: dict[str, Any] | None, root: Location, version_name: str, rank: int, broadcast: Callable[[Any], Any]
) -> None:
    """Rank 0 writes ``meta`` last (:func:`publish_version`); a failure there raises on every rank."""
    published = attempt(publish_version, meta, root, version_name) if rank == 0 else None
    raise_any([broadcast(published)])


def remove_unpublished(version: Location) -> None:
    with contextlib.suppress(OSError):  # the save's own error matters more; the next save deletes the rest
        version.remove()


def _begin(root: Location, meta: dict[str, Any]) -> tuple[str, str, tuple[str, ...]]:
    """Rank 0 starts a save: the new version's name, the save id, and which shard tensors every rank writes.

    A checkpoint without optimizer state (``ModelCheckpoint(save_weights_only=True)``, a Fabric save of the
    model alone) gets the master weights only: its moments would be 2/3 of the shards' bytes, never read.
    """
    return *new_version(root), SHARD_KEYS if "optimizer_states" in meta else SHARD_KEYS[:1]


def new_version(root: Location) -> tuple[str, str]:
    """Create the next version directory (never reusing a name that exists); its name and a new save id."""
    kind = directory_kind(root)
    if kind == "not a directory" and root.exists():
        raise CheckpointError(
            f"{root} is a single-file checkpoint; a sharded one cannot replace it in place. "
            "Delete it or save under another name"
        )
    if kind == "other":
        held = root.children()
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise CheckpointError(
            f'zero_offload cannot save a sharded checkpoint (checkpoint_format="sharded") to {root}: it is an '
            f"existing directory that is not a checkpoint (it holds {shown}), and a sharded checkpoint is a "
            f"directory of its own. Give the checkpoint a path of its own, such as {root / 'last.ckpt'}"
        )
    root.make_dirs()
    remove_stale_temporaries(root)
    versions = _versions(root)
    number = versions[0][0] + 1 if versions else 1
    while not (root / f"v{number:06d}").make_dir_exclusive():
        number += 1
    return f"v{number:06d}", uuid.uuid4().hex


def publish_version(meta: dict[str, Any], root: Location, version_name: str) -> None:
    version = root / version_name
    save_file(meta, version / META_FILE)  # the new checkpoint is the current one from here on
    version.fsync_dir()
    for name in root.children():  # the earlier versions; what else is there (an export, notes) is not ours
        if name != version_name and (_VERSION.match(name) or name == META_FILE or name.startswith("shard_")):
            _remove_version(root / name)  # a version, or a version-1 layout's meta.pt and shards


def attempt(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as error:  # handed to every rank, which all raise it
        return _Failure(f"{type(error).__name__}: {error}")


class _Failure(str):
    """A failed step's message, sent through the collectives in place of its result."""


def raise_any(results: list[Any]) -> list[Any]:
    """The results of a step, one per rank (or rank 0's alone); raise if any rank failed."""
    failed = [(rank, r) for rank, r in enumerate(results) if isinstance(r, _Failure)]
    if failed:
        who = ", ".join(f"rank {rank}" for rank, _ in failed)
        raise CheckpointError(f"saving the sharded checkpoint failed on {who}: {failed[0][1]}")
    return results


def _remove_version(version: Location) -> None:
    """The marker goes first, so a half-deleted version is never taken for a complete one."""
    if version.is_dir() and not version.is_link():
        (version / META_FILE).remove()
    version.remove()


def load_sharded(path: PathLike, with_optimizer: bool = True, weights_only: bool = True) -> dict[str, Any]:
    """Read a sharded checkpoint directory as an ordinary full Lightning checkpoint dict.

    ``state_dict`` gets the master weights (fp32, or bf16 as a ``cpu_state="bf16"`` run saved them) and
    ``optimizer_states`` a torch AdamW state dict, so
    the rest of the loading path is the same as for the full format, whatever the world size now.
    ``weights_only`` applies to ``meta.pt`` (which holds the user's hyperparameters); shards hold tensors only.
    A checkpoint saved without optimizer state (weights only) loads without ``optimizer_states``, as a
    full-format one does, whatever ``with_optimizer`` asks.
    """
    root = Location.of(path)
    version = current_version(root)
    if version is None:
        raise CheckpointError(no_complete_version(root))
    meta_file = version / META_FILE
    check_zip_checksums(meta_file, "metadata")
    checkpoint = load_file(meta_file, "metadata", weights_only=weights_only)
    info = checkpoint.get(FORMAT_KEY) if isinstance(checkpoint, dict) else None
    if isinstance(info, dict) and info.get("format") == "distributed":
        if not (version / DCP_METADATA).is_file():  # the DCP index, which decides the format: a copy that lost it
            raise CheckpointError(
                f"file {version / DCP_METADATA} of the checkpoint is missing (torch.distributed.checkpoint's index; "
                "`cp dir/*` skips it, being a dot-file): copy the checkpoint directory whole"
            )
        raise CheckpointError(
            f"{root} was saved with offload_params=True (torch.distributed.checkpoint files): read it with "
            "lightning_zero_offload.checkpoints.distributed.load_sharded_full, or resume with offload_params=True"
        )
    if not isinstance(info, dict) or info.get("format") != "sharded":
        raise CheckpointError(f"metadata {meta_file} does not describe a zero_offload sharded checkpoint")
    if "layout_crc32" in info and layout_checksum(info) != info["layout_crc32"]:
        raise CheckpointError(f"metadata {meta_file} was modified after it was saved (its layout checksum differs)")
    with_optimizer = with_optimizer and "optimizer_states" in checkpoint
    try:
        shards = _load_shards(version, info, with_optimizer)
        full = assemble_params(shards, info, SHARD_KEYS if with_optimizer else SHARD_KEYS[:1])
    except CheckpointError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as error:
        raise CheckpointError(
            f"metadata {meta_file} does not match its shards ({type(error).__name__}: {error})"
        ) from None

    state_dict = checkpoint.setdefault("state_dict", {})
    for param, weight in zip(info["params"], full["master"]):
        for key in param["keys"]:
            state_dict[key] = weight
    if with_optimizer:
        saved = checkpoint["optimizer_states"][0]
        state = dict(saved["state"])  # frozen parameters' state, whole in meta.pt (not in the layout)
        for param, m, v in zip(info["params"], full["exp_avg"], full["exp_avg_sq"]):
            if param["step"] > 0:
                step = torch.tensor(float(param["step"]), dtype=torch.float32)
                state[param["torch_index"]] = {"step": step, "exp_avg": m, "exp_avg_sq": v}
        checkpoint["optimizer_states"] = [{**saved, "state": state}]  # Fabric's engine state rides along in it
    return checkpoint


def no_complete_version(root: Location) -> str:
    incomplete = _incomplete_versions(root)
    if not incomplete:
        return f"{root} holds no sharded checkpoint (no version directory with a {META_FILE})"
    return (
        f"zero_offload cannot load {root}: it is a sharded checkpoint directory with no complete version, only "
        f"what an interrupted save left ({', '.join(incomplete)}: no {META_FILE}, which a save writes last). The "
        "save was killed or crashed before it finished (or is still running). Resume from an earlier checkpoint "
        "of the run; the next save to this path deletes the incomplete version"
    )


def _load_shards(version: Location, info: dict[str, Any], with_optimizer: bool) -> list[dict[str, torch.Tensor]]:
    world = info["world_size"]
    records = info.get("shards")  # absent in version-1 checkpoints, which have no checksums
    if records is not None and len(records) != world:
        raise CheckpointError(f"metadata {version / META_FILE} lists {len(records)} shards for world size {world}")
    needed = max((b["shard_start"] + b["shard_numel"] for b in info["buckets"]), default=0)
    shards = []
    for rank in range(world):
        source = version / shard_file(rank)
        what = f"shard {rank} of {world} of the sharded checkpoint"
        if not source.is_file():
            raise CheckpointError(f"{what} {source} is missing")
        expected = FileRecord(**records[rank]) if records is not None else None
        if expected is not None and (size := file_size(source)) != expected.size:
            raise CheckpointError(
                f"{what} {source} has {size} bytes, the metadata says {expected.size}: truncated or replaced"
            )
        shard = load_file(source, what, mmap=source.fs is None)
        if expected is not None:
            if not isinstance(shard, dict) or shard.get("save_id") != info["save_id"]:
                raise CheckpointError(f"{what} {source} belongs to another save than its metadata (mixed checkpoints)")
            if file_record(source).crc32 != expected.crc32:
                raise CheckpointError(f"{what} {source} does not match its checksum in the metadata: corrupt or edited")
        for key in SHARD_KEYS if with_optimizer else SHARD_KEYS[:1]:
            parts = [shard.get(key), shard.get(key + DEVICE_PART, torch.empty(0))]
            valid = all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in parts)
            if not valid or sum(t.numel() for t in parts) < needed:  # type: ignore[union-attr]
                raise CheckpointError(f"{what} {source} has no valid {key!r} tensor")
        shards.append(shard)
    return shards
