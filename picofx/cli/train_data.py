"""picofx train's data: a byte-level tokenizer (256 tokens) over the standard library's source,
a text file, or a Hugging Face dataset's text column; or, with --model, the model's own tokenizer
over the same sources, tokenized once into a memory-mapped token file (picofx.data). Random
windows as batches, prepared in the background, whose position (the sampler's state) is saved
and restored with the run."""
from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import pathlib
import re
import sysconfig

import torch

from picofx.data import TokenFile, WindowLoader, Windows, token_file
from picofx.data.hub import offline_unless_the_hub_answers
from picofx.data.windows import inputs_and_labels
from picofx.data.tokens import MappedTokens, content_hash
from picofx.parallel.launch import once_per_machine
from picofx.runtime.cache import default_directory

TEXT_COLUMNS = ("text", "content")
JSON_LINES = (".jsonl", ".ndjson")  # --data files read as one JSON record a line, each record's text a document
HUB_NAME = re.compile(r"[\w-][\w.-]*(/[\w-][\w.-]*)?")  # a dataset on the hub: NAME or OWNER/NAME
STDLIB_BYTES = 4_000_000  # of the standard library's source, the default data
PIECE_CHARACTERS = 1 << 20  # a long text file goes to the tokenizer in pieces of about this size, cut at line ends


class DataError(ValueError):
    """The data cannot give the batches asked for; the message says what to change."""


def bytes_as_tokens(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def stdlib_files(max_bytes: int) -> list[pathlib.Path]:
    """The standard library's .py files, in name order, until they hold `max_bytes`."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.glob("*.py")):
        files.append(path)
        total += path.stat().st_size
        if total >= max_bytes:
            break
    return files


def stdlib_corpus(max_bytes: int) -> torch.Tensor:
    """Bytes of the standard library's .py files, as token ids (one per byte)."""
    return bytes_as_tokens(b"".join(p.read_bytes() for p in stdlib_files(max_bytes))[:max_bytes])


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
    if not path.exists() and not HUB_NAME.fullmatch(source):
        raise ValueError(f"--data {source}: no such file (nor a Hugging Face dataset name, OWNER/NAME)")
    if not has_datasets():
        what = "a directory" if path.is_dir() else "no such file"
        raise ValueError(f"--data {source}: {what}; a text file is read as bytes, and a dataset (saved with "
                         "save_to_disk, or a Hugging Face name) needs the datasets package: pip install 'picofx[hf]'")


def dataset_text(source: str) -> bytes:
    """The text column of a dataset saved on disk (`Dataset.save_to_disk`) or on the Hugging Face
    hub (its train split), rows joined by newlines, as UTF-8 bytes."""
    return "\n".join(dataset_rows(source)).encode("utf-8")


def dataset_rows(source: str) -> list[str]:
    """The text column of a dataset saved on disk or on the hub (its train split), one row a document."""
    import datasets

    if pathlib.Path(source).is_dir():
        data = datasets.load_from_disk(source)
    else:
        offline = offline_unless_the_hub_answers()
        try:
            data = datasets.load_dataset(source, split="train")
        except Exception as e:  # no network, no such dataset: one line, not datasets' traceback
            unreached = " (the hub did not answer: only a copy in the local cache could load)" if offline else ""
            raise DataError(f"--data {source}: datasets could not load it{unreached} ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if isinstance(data, datasets.DatasetDict):
        data = data["train"] if "train" in data else next(iter(data.values()))
    column = next((c for c in TEXT_COLUMNS if c in data.column_names), None)
    if column is None:
        raise DataError(f"--data {source}: no text column (looked for {', '.join(TEXT_COLUMNS)}; it has "
                         f"{', '.join(data.column_names)})")
    return list(data[column])


def is_json_lines(path: pathlib.Path) -> bool:
    return path.suffix.lower() in JSON_LINES


def json_lines_rows(path: pathlib.Path) -> list[str]:
    """The text field of each line of a JSON Lines file (one record a line, blank lines skipped)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"--data {path}: line {number} is not JSON ({e.msg}): a .jsonl file holds one "
                                "JSON object a line") from None
            column = next((c for c in TEXT_COLUMNS if isinstance(record, dict) and c in record), None)
            if column is None:
                found = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                raise DataError(f"--data {path}: line {number} has no text field (looked for "
                                f"{', '.join(TEXT_COLUMNS)}; it has {found})")
            rows.append(str(record[column]))
    return rows


def load_tokens(source: str | None, max_bytes: int = STDLIB_BYTES) -> torch.Tensor:
    """Token ids (bytes) of `source`: None is the standard library's source."""
    if source is None:
        return stdlib_corpus(max_bytes)
    path = pathlib.Path(source)
    if path.is_file() and is_json_lines(path):
        data = "\n".join(json_lines_rows(path)).encode("utf-8")
    else:
        data = path.read_bytes() if path.is_file() else dataset_text(source)
    return bytes_as_tokens(data[:max_bytes])


def text_pieces(path: pathlib.Path):
    """A text file as one document, in pieces of about PIECE_CHARACTERS cut at line ends."""
    pieces, piece, size = [], [], 0
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        for line in f:
            piece.append(line)
            size += len(line)
            if size >= PIECE_CHARACTERS:
                pieces.append("".join(piece))
                piece, size = [], 0
    if piece or not pieces:
        pieces.append("".join(piece))
    return pieces


def documents(source: str | None, max_bytes: int = STDLIB_BYTES):
    """The documents of `source`, each as a list of text pieces: a text file is one document, a
    dataset's rows are one each; None is the standard library's source, a file a document."""
    if source is None:
        for file in stdlib_files(max_bytes):
            yield text_pieces(file)
        return
    path = pathlib.Path(source)
    if path.is_file() and not is_json_lines(path):
        yield text_pieces(path)
        return
    for row in json_lines_rows(path) if path.is_file() else dataset_rows(source):
        yield [row]


def data_key(source: str | None, max_bytes: int = STDLIB_BYTES) -> str:
    """What identifies the data: a file's or a saved dataset's bytes, a hub dataset's name."""
    if source is None:
        return "stdlib " + " ".join(f"{p}:{p.stat().st_size}" for p in stdlib_files(max_bytes))
    path = pathlib.Path(source)
    return f"file {content_hash(path)}" if path.exists() else f"hub {source} train"


def tokenized(source: str, tokenizer, cache: str | None) -> tuple[TokenFile, str]:
    """`source` under the model's `tokenizer`, as a token file in `cache` (by default picofx's cache
    directory, tokens/), tokenized by one rank of each machine; and a line saying whether it was
    tokenized now or reused."""
    directory = pathlib.Path(cache) if cache else pathlib.Path(os.environ.get("PICOFX_CACHE_DIR") or
                                                                default_directory()) / "tokens"
    key = data_key(source)

    def make() -> TokenFile:
        return token_file(tokenizer, documents(source), data_key=key, cache=directory, describe=source)
    found = once_per_machine(make, f"tokens {directory.resolve()} {key}")  # the machine's other ranks map it
    how = (f"tokenized in {found.tokenized_seconds:.1f}s into" if found.tokenized_seconds is not None
           else "mapped, tokenized by an earlier run:")
    return found, f"data: {found.count:,} tokens of {source or 'the standard library'}, {how} {found.path}"


class Batches:
    """Random windows of seq+1 tokens: inputs and next-token labels (already shifted, as the seed
    does). The last 5% of the tokens are the validation split. `sample` draws a batch here and now;
    after `prefetch`, `next` hands out the batches DataLoader workers prepared ahead, the same ones
    `sample` would have drawn, and `state_dict` is the position after the last one handed out."""

    def __init__(self, tokens: torch.Tensor | MappedTokens, batch: int, seq: int, seed: int):
        split = int(0.95 * len(tokens))
        train, val = tokens.split(split) if isinstance(tokens, MappedTokens) else (tokens[:split], tokens[split:])
        self.train, self.val = Windows(train, seq), Windows(val, seq)
        self.batch, self.seq = batch, seq
        shortest = min(len(train), len(val))
        if shortest < seq + 2:
            raise DataError(f"the data holds {len(tokens):,} tokens; --seq {seq} needs at least "
                             f"{20 * (seq + 2):,} (a window of seq + 1 in each of the train and validation splits)")
        self.generator = torch.Generator().manual_seed(seed)
        self.loader: WindowLoader | None = None
        self.waited, self.handed_out, self.workers = 0.0, 0, 0

    def sample(self, split: str = "train") -> dict:
        self.stop()
        windows = self.train if split == "train" else self.val
        return inputs_and_labels([windows[s] for s in windows.starts(self.generator, self.batch)])

    def prefetch(self, device: str, workers: int) -> None:
        """From here on, `next` hands out batches `workers` processes prepare ahead (0: none; none
        either in a daemonic process, such as a rank multiprocessing started, which has no children)."""
        self.stop()
        self.workers = 0 if multiprocessing.current_process().daemon else workers
        self.loader = WindowLoader(self.train, self.generator, self.batch, workers=self.workers, device=device)

    def next(self) -> dict:
        return self.loader.next()

    def stop(self) -> None:
        """End the workers; the generator goes back to the position after the last batch handed out."""
        if self.loader is not None:
            self.generator.set_state(self.loader.stop())
            self.waited += self.loader.waited
            self.handed_out += self.loader.handed_out
            self.loader = None

    def wait_line(self, run_seconds: float, steps: int) -> str:
        """How long the steps waited for their batches, in all and per step."""
        self.stop()
        ahead = f"{self.workers} worker{'s' if self.workers > 1 else ''} preparing batches ahead" if self.workers \
            else "batches prepared when asked for"
        return (f"data: a step waited {1e3 * self.waited / max(1, steps):.2f} ms for its batch, "
                f"{100 * self.waited / run_seconds:.2f}% of the run ({ahead})")

    def state_dict(self) -> dict:
        return {"generator": self.loader.position if self.loader is not None else self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.stop()
        self.generator.set_state(state["generator"])
