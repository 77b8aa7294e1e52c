"""Checkpoints on disk: formats, files, integrity, the streamed writer, the fp32 export.

Plain torch (and fsspec for remote paths); the engine is read only through its public state. In the order
a save runs through it:

- :mod:`.keys`: the entries this package adds to a Lightning checkpoint;
- :mod:`.full`: the full format (one file, written atomically, loaded memory-mapped);
- :mod:`.sharded`: the sharded format (a versioned directory, each rank's shard checked on load);
- :mod:`.distributed`: the sharded format of ``offload_params=True``: torch.distributed.checkpoint's files in
  the same versioned directory (:mod:`.distributed_files`: reading them without pickled code, checked);
- :mod:`.streamed`: a full save at several ranks, buckets streamed to rank 0's writer;
- :mod:`.writer`: ``torch.save``'s bytes into a file object, with their size and CRC-32;
- :mod:`.files`: where bytes go (the local disk, atomically, or fsspec) and every read error named;
- :mod:`.export`: the fp32 ``state_dict`` export, the Hugging Face folder export (:mod:`.hugging_face`: the
  safetensors files) and ``zero-offload-convert`` (of every format).
"""

from lightning_zero_offload.checkpoints.export import convert_checkpoint_to_fp32_state_dict, export_hugging_face
from lightning_zero_offload.checkpoints.files import CheckpointError, PathLike
from lightning_zero_offload.checkpoints.full import atomic_save, load_checkpoint_file
from lightning_zero_offload.checkpoints.hugging_face import save_hugging_face
from lightning_zero_offload.checkpoints.keys import ENGINE_STATE_KEY, FABRIC_KEY, FORMAT_KEY
from lightning_zero_offload.checkpoints.sharded import (
    META_FILE,
    current_version,
    is_sharded_checkpoint,
    load_sharded,
    save_sharded,
    shard_file,
    sharded_layout,
)

__all__ = [
    "ENGINE_STATE_KEY",
    "FABRIC_KEY",
    "FORMAT_KEY",
    "META_FILE",
    "CheckpointError",
    "PathLike",
    "atomic_save",
    "convert_checkpoint_to_fp32_state_dict",
    "current_version",
    "export_hugging_face",
    "is_sharded_checkpoint",
    "load_checkpoint_file",
    "load_sharded",
    "save_hugging_face",
    "save_sharded",
    "shard_file",
    "sharded_layout",
]
