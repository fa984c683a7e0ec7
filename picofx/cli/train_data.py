"""picofx train's data: a byte-level tokenizer (256 tokens) over the standard library's source,
a text file, or a Hugging Face dataset's text column; random windows as batches, whose position
(the sampler's state) is saved and restored with the run."""
from __future__ import annotations

import importlib.util
import pathlib
import sysconfig

import torch

TEXT_COLUMNS = ("text", "content")


class DataError(ValueError):
    """The data cannot give the batches asked for; the message says what to change."""


def bytes_as_tokens(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def stdlib_corpus(max_bytes: int) -> torch.Tensor:
    """Bytes of the standard library's .py files, as token ids (one per byte)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return bytes_as_tokens(b"".join(chunks)[:max_bytes])


def has_datasets() -> bool:
    return importlib.util.find_spec("datasets") is not None


def check_data_source(source: str) -> None:
    """Raise ValueError (the message says what to do) when `source` cannot be read: before any
    process group or compile."""
    path = pathlib.Path(source)
    if path.is_file():
        if path.stat().st_size == 0:
            raise ValueError(f"--data {source}: the file is empty")
        return
    if not has_datasets():
        what = "a directory" if path.is_dir() else "no such file"
        raise ValueError(f"--data {source}: {what}; a text file is read as bytes, and a dataset (saved with "
                         "save_to_disk, or a Hugging Face name) needs the datasets package: pip install datasets")


def dataset_text(source: str) -> bytes:
    """The text column of a dataset saved on disk (`Dataset.save_to_disk`) or on the Hugging Face
    hub (its train split), rows joined by newlines, as UTF-8 bytes."""
    import datasets

    if pathlib.Path(source).is_dir():
        data = datasets.load_from_disk(source)
    else:
        try:
            data = datasets.load_dataset(source, split="train")
        except Exception as e:  # no network, no such dataset: one line, not datasets' traceback
            raise DataError(f"--data {source}: datasets could not load it ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if isinstance(data, datasets.DatasetDict):
        data = data["train"] if "train" in data else next(iter(data.values()))
    column = next((c for c in TEXT_COLUMNS if c in data.column_names), None)
    if column is None:
        raise DataError(f"--data {source}: no text column (looked for {', '.join(TEXT_COLUMNS)}; it has "
                         f"{', '.join(data.column_names)})")
    return "\n".join(data[column]).encode("utf-8")


def load_tokens(source: str | None, max_bytes: int = 4_000_000) -> torch.Tensor:
    """Token ids (bytes) of `source`: None is the standard library's source."""
    if source is None:
        return stdlib_corpus(max_bytes)
    path = pathlib.Path(source)
    data = path.read_bytes() if path.is_file() else dataset_text(source)
    return bytes_as_tokens(data[:max_bytes])


class Batches:
    """Random windows of seq+1 bytes: inputs and next-byte labels (already shifted, as the seed does).
    The last 5% of the tokens are the validation split."""

    def __init__(self, tokens: torch.Tensor, batch: int, seq: int, seed: int):
        split = int(0.95 * len(tokens))
        self.train, self.val = tokens[:split], tokens[split:]
        self.batch, self.seq = batch, seq
        shortest = min(len(self.train), len(self.val))
        if shortest < seq + 2:
            raise DataError(f"the data holds {len(tokens):,} tokens; --seq {seq} needs at least "
                             f"{20 * (seq + 2):,} (a window of seq + 1 in each of the train and validation splits)")
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, split: str = "train") -> dict:
        data = self.train if split == "train" else self.val
        starts = torch.randint(0, len(data) - self.seq - 1, (self.batch,), generator=self.generator)
        windows = torch.stack([data[s:s + self.seq + 1] for s in starts.tolist()])  # (B, T+1)
        return {"input_ids": windows[:, :-1].contiguous(), "labels": windows[:, 1:].contiguous()}

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
