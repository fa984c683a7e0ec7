"""Training data for causal LMs: documents tokenized once into a memory-mapped token file that
later runs reuse (`tokens.py`), and random windows of it drawn as batches, prepared in the
background by DataLoader workers, at a position saved and restored with the run (`windows.py`)."""
from picofx.data.tokens import TokenFile, token_file
from picofx.data.windows import WindowLoader, Windows

__all__ = ["TokenFile", "token_file", "WindowLoader", "Windows"]
