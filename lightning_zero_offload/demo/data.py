"""A byte-level language-modelling corpus built at run time from the Python standard library's sources.

Nothing is downloaded: the text is the ``*.py`` files of the interpreter that runs the job
(``sysconfig.get_paths()["stdlib"]``), which every Python installation has. The corpus is deterministic for
a given interpreter: files are visited in sorted order of their relative path, and the train/val split is
decided per file by a stable hash of that path, so no file contributes to both splits.
"""

from __future__ import annotations

import hashlib
import math
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, RandomSampler

VOCAB_SIZE = 256

# Directory names never read: installed third-party packages, the test suites (large, repetitive and
# full of odd byte strings), caches and the vendored ``ensurepip`` wheels.
_SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "__pycache__",
        "_bundled",
    }
)


def stdlib_dir() -> Path:
    """The directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root: Path) -> list[str]:
    """Relative POSIX paths of the ``*.py`` files under ``root``, sorted, skipping ``_SKIP_DIRS``."""
    root = Path(root)
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in _SKIP_DIRS for part in rel.parts[:-1]):
            continue
        if not path.is_file():
            continue
        found.append(rel.as_posix())
    return sorted(found)


def is_val_file(rel_path: str, val_fraction: float) -> bool:
    """Stable per-file split: a file goes to validation when its path hashes below ``val_fraction``."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


class _Windows(Dataset):
    """Windows of ``block_size + 1`` bytes of ``data`` starting at ``offsets``; item ``i`` is ``(x, y)``
    with ``y`` the window shifted by one byte. Subclasses choose the offsets."""

    data: torch.Tensor
    block_size: int
    offsets: torch.Tensor

    def __len__(self) -> int:
        return self.offsets.numel()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.offsets[index])
        chunk = self.data[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class RandomWindowDataset(_Windows):
    """``num_samples`` windows of ``block_size + 1`` bytes at random offsets, fixed by ``seed``.

    Item ``i`` is ``(x, y)`` with ``y`` the window shifted by one byte. The offsets are drawn once, so the
    dataset is a plain map-style dataset (works with any sampler, ``DistributedSampler`` included).
    """

    def __init__(self, data: torch.Tensor, block_size: int, num_samples: int, seed: int) -> None:
        if data.numel() < block_size + 1:
            raise ValueError(
                f"The training text has {data.numel()} bytes, fewer than block_size + 1 = {block_size + 1}."
            )
        self.data = data
        self.block_size = block_size
        generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.randint(0, data.numel() - block_size, (num_samples,), generator=generator)


class ChunkDataset(_Windows):
    """Non-overlapping windows of ``block_size + 1`` bytes, evenly spread over ``data``.

    With more chunks available than ``max_samples``, an evenly spaced subset is taken so that the whole
    text (every validation file) is still represented.
    """

    def __init__(self, data: torch.Tensor, block_size: int, max_samples: int | None = None) -> None:
        n_chunks = (data.numel() - 1) // block_size
        if n_chunks < 1:
            raise ValueError(
                f"The validation text has {data.numel()} bytes, fewer than block_size + 1 = {block_size + 1}."
            )
        n = n_chunks if max_samples is None else min(n_chunks, max_samples)
        chunk_ids = torch.linspace(0, n_chunks - 1, n).round().long().unique()
        self.data = data
        self.block_size = block_size
        self.offsets = chunk_ids * block_size


class EpochShuffle(RandomSampler):
    """A random order drawn from ``(seed, epoch)``, not from the global generator's state at the epoch's
    start, which a resumed run does not have: Lightning calls ``set_epoch`` before each epoch, so a
    resumed run draws the order the uninterrupted one drew. Without ``set_epoch`` every epoch continues
    the generator: another order each time, the same in every run."""

    def __init__(self, data_source: Dataset, seed: int) -> None:
        super().__init__(data_source, generator=torch.Generator())
        self.seed = seed
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        # torch's CPU generator keeps 32 bits of its seed: hash the pair into them rather than pack it.
        key = hashlib.blake2b(f"{self.seed}:{epoch}".encode(), digest_size=4).digest()
        self.generator.manual_seed(int.from_bytes(key, "little"))


class ResumableLoader(DataLoader):
    """A DataLoader Lightning saves in checkpoints (it has ``state_dict``): the batches of the epoch already
    given out and its sampler's seed, so a run resumed mid-epoch goes on with the next batch rather than
    starting the epoch again (Lightning warns that a loader without this is "not resumable")."""

    _given = 0  # batches of the current epoch given out
    _skip = 0  # batches to pass over at the next epoch's start: set by load_state_dict

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        batches = super().__iter__()
        if skip >= len(self):  # saved at the epoch's end: the next one starts from its first batch
            skip = 0
        for _ in range(skip):
            next(batches)
        self._given = skip
        for batch in batches:
            self._given += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        state = {"batches_given": self._given}
        if isinstance(self.sampler, EpochShuffle):
            state["shuffle_seed"] = self.sampler.seed
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = state["batches_given"]
        if "shuffle_seed" in state and isinstance(self.sampler, EpochShuffle):
            self.sampler.seed = state["shuffle_seed"]
            self.sampler.set_epoch(self.sampler.epoch)


class StdlibCorpusDataModule(LightningDataModule):
    """Byte-level (vocabulary 256) LM data from the standard library's own ``*.py`` sources.

    Args:
        block_size: Sequence length in bytes; each sample is ``(x, y)`` of this length, ``y`` shifted by one.
        batch_size: Per-device batch size for both splits.
        max_bytes: Cap on the total bytes read (train + val); files are taken in sorted order until the
            next file would pass the cap.
        val_fraction: Fraction of *files* (by a stable hash of their relative path) held out for validation.
        samples_per_epoch: Random training windows per epoch; ``None`` means one window per ``block_size``
            bytes of training text.
        val_samples: Cap on the number of fixed validation windows (evenly spread over the val text).
        num_workers: ``DataLoader`` workers.
        seed: Seed for the training window offsets.
        root: Directory to read instead of the standard library (``None``: ``sysconfig``'s ``stdlib``).
    """

    def __init__(
        self,
        block_size: int = 256,
        batch_size: int = 32,
        max_bytes: int = 8_000_000,
        val_fraction: float = 0.05,
        samples_per_epoch: int | None = None,
        val_samples: int | None = 256,
        num_workers: int = 0,
        seed: int = 1234,
        root: str | None = None,
    ) -> None:
        super().__init__()
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if max_bytes < 2 * (block_size + 1):
            raise ValueError(f"max_bytes={max_bytes} is too small for block_size={block_size}")
        self.save_hyperparameters()
        self.block_size = block_size
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.samples_per_epoch = samples_per_epoch
        self.val_samples = val_samples
        self.num_workers = num_workers
        self.seed = seed
        self.root = Path(root) if root is not None else stdlib_dir()

        self.train_files: list[str] = []
        self.val_files: list[str] = []
        self.train_data: torch.Tensor | None = None
        self.val_data: torch.Tensor | None = None
        self.train_dataset: RandomWindowDataset | None = None
        self.val_dataset: ChunkDataset | None = None

    # ------------------------------------------------------------------------------------------------ build
    def _load(self) -> None:
        if self.train_data is not None:
            return
        files = list_source_files(self.root)
        if not files:
            raise FileNotFoundError(
                f"No *.py files found under {str(self.root)!r} (outside site-packages and test directories). "
                "StdlibCorpusDataModule builds its corpus from the Python standard library's sources; this "
                "interpreter seems to ship without them. Pass `root=` pointing at a directory of .py files, "
                "or use another datamodule (`--data.class_path ...`)."
            )
        chosen: list[tuple[str, bytes, bool]] = []  # (relative path, text, is validation)
        total = 0
        for rel in files:
            text = (self.root / rel).read_bytes()
            if not text:
                continue
            if total + len(text) > self.max_bytes:
                if total > 0:
                    break
                text = text[: self.max_bytes]
            total += len(text)
            chosen.append((rel, text, is_val_file(rel, self.val_fraction)))
        n_val = sum(v for _, _, v in chosen)
        if n_val in (0, len(chosen)):
            # Tiny caps can leave one side empty: move the last file read across so both splits exist.
            if len(chosen) < 2:
                raise ValueError(
                    f"max_bytes={self.max_bytes} admits only {len(chosen)} file(s) under "
                    f"{str(self.root)!r}; need at least two to split train/val by file. Increase max_bytes."
                )
            rel, text, is_val = chosen[-1]
            chosen[-1] = (rel, text, not is_val)
        self.train_files = [rel for rel, _, v in chosen if not v]
        self.val_files = [rel for rel, _, v in chosen if v]
        train = b"".join(text for _, text, v in chosen if not v)
        val = b"".join(text for _, text, v in chosen if v)
        self.train_data = torch.frombuffer(bytearray(train), dtype=torch.uint8)
        self.val_data = torch.frombuffer(bytearray(val), dtype=torch.uint8)

    def prepare_data(self) -> None:
        # Nothing to download; the corpus is read from local files in `setup` on every rank.
        pass

    def setup(self, stage: str | None = None) -> None:
        self._load()
        assert self.train_data is not None and self.val_data is not None
        if self.train_dataset is None:
            n = self.samples_per_epoch
            if n is None:
                n = max(1, self.train_data.numel() // self.block_size)
            self.train_dataset = RandomWindowDataset(self.train_data, self.block_size, n, self.seed)
        if self.val_dataset is None:
            self.val_dataset = ChunkDataset(self.val_data, self.block_size, self.val_samples)

    # ------------------------------------------------------------------------------------------ loaders
    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        # The order's seed is the run's (seed_everything sets it) and is saved with the loader's position.
        return ResumableLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=EpochShuffle(self.train_dataset, torch.initial_seed()),
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        return DataLoader(
            self.val_dataset,
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    # ------------------------------------------------------------------------------------------ baseline
    def unigram_perplexity(self) -> float:
        """Perplexity of a unigram byte model fitted on the training text, on the validation targets.

        The unigram uses add-one smoothing over the 256 byte values (so an unseen byte does not give an
        infinite perplexity) and is evaluated on exactly the target bytes the validation loop scores, so it
        is directly comparable to the model's ``val_ppl``.
        """
        self.setup("validate")
        assert self.train_data is not None and self.val_dataset is not None
        counts = torch.bincount(self.train_data.long(), minlength=VOCAB_SIZE).double() + 1.0
        log_probs = counts.log() - counts.sum().log()
        offsets = self.val_dataset.offsets
        idx = offsets[:, None] + 1 + torch.arange(self.block_size)[None, :]
        targets = self.val_data[idx.reshape(-1)].long()
        nll = -log_probs[targets].mean().item()
        return math.exp(nll)
