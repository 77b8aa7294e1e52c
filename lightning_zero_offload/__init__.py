"""ZeRO-Offload for PyTorch Lightning."""
