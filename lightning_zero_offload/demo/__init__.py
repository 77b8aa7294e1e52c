"""The main job's embedded default: a small byte-level GPT on the Python standard library's sources."""

from lightning_zero_offload.demo.data import StdlibCorpusDataModule
from lightning_zero_offload.demo.model import GPT

__all__ = ["GPT", "StdlibCorpusDataModule"]
