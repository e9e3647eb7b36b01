"""diagnose: explain the seconds per iteration of a LoRA training run on a GPU or CPU."""

__version__ = "0.1.0"
