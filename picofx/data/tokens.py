"""Documents tokenized once into a memory-mapped token file.

`<cache>/<key>.bin` holds one stream of token ids: every document's, each followed by the
end-of-sequence token (uint16 when the vocabulary fits, else uint32). `<key>.json`, written after
the stream is complete, says what the stream holds; a run that finds it maps the stream instead of
tokenizing again. The key hashes the tokenizer (its vocabulary, merges, normalizer and special
tokens) and the data, so another tokenizer or changed data gets a file of its own.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import time
from typing import Iterable, Iterator

import numpy as np
import torch

PIECES_PER_CALL = 256  # text pieces handed to the tokenizer at once (a fast tokenizer batches them)


@dataclasses.dataclass(frozen=True)
class MappedTokens:
    """Tokens `begin` to `end` of a token file, mapped on first read (also in a DataLoader worker,
    which receives the path, not the tokens)."""
    path: str
    dtype: str
    begin: int
    end: int

    def __len__(self) -> int:
        return self.end - self.begin

    def split(self, at: int) -> tuple[MappedTokens, MappedTokens]:
        middle = self.begin + at
        return dataclasses.replace(self, end=middle), dataclasses.replace(self, begin=middle)

    def read(self, start: int, count: int) -> torch.Tensor:
        """Tokens start to start + count of this range, as int64."""
        array = np.memmap(self.path, dtype=self.dtype, mode="r")
        return torch.from_numpy(array[self.begin + start:self.begin + start + count].astype(np.int64))


@dataclasses.dataclass(frozen=True)
class TokenFile:
    path: pathlib.Path   # the .bin stream
    count: int
    dtype: str
    tokenized_seconds: float | None  # None: an earlier run's file, mapped as it was

    def tokens(self) -> MappedTokens:
        return MappedTokens(str(self.path), self.dtype, 0, self.count)

    def array(self) -> np.memmap:
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.count,))


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what decides the ids: a fast tokenizer's whole definition, and its special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    special = f"eos={tokenizer.eos_token_id} bos={tokenizer.bos_token_id} size={len(tokenizer)}"
    return hashlib.sha256((definition + special).encode()).hexdigest()


def token_ids(tokenizer, documents: Iterable[list[str]]) -> Iterator[np.ndarray]:
    """Each document's ids followed by the end-of-sequence token. A document comes as pieces (a
    long file in parts cut at line ends); special tokens the tokenizer adds (a BOS) go before the
    first piece only."""
    eos = tokenizer.eos_token_id
    pending: list[tuple[str, bool, bool]] = []  # (text, first piece, last piece)

    def flush():
        firsts = [i for i, (_, first, _) in enumerate(pending) if first]
        ids: list[list[int] | None] = [None] * len(pending)
        for indices, special in ((firsts, True), ([i for i in range(len(pending)) if i not in firsts], False)):
            if indices:
                encoded = tokenizer([pending[i][0] for i in indices], add_special_tokens=special)["input_ids"]
                for i, e in zip(indices, encoded):
                    ids[i] = e
        stream = [t for (_, _, last), e in zip(pending, ids) for t in (e + [eos] if last and eos is not None else e)]
        pending.clear()
        return np.asarray(stream, dtype=np.int64)

    for pieces in documents:
        for i, piece in enumerate(pieces):
            pending.append((piece, i == 0, i == len(pieces) - 1))
            if len(pending) >= PIECES_PER_CALL:
                yield flush()
    if pending:
        yield flush()


def token_file(tokenizer, documents: Iterable[list[str]], *, data_key: str, cache: pathlib.Path,
               describe: str = "") -> TokenFile:
    """The token file of `documents` under `tokenizer`: found in `cache` by its key, or tokenized
    now and written there (each writer to its own temporary name, renamed whole: ranks that
    tokenize the same data at once each write the same file, and none reads a partial one)."""
    key = hashlib.sha256(f"{tokenizer_fingerprint(tokenizer)} {data_key}".encode()).hexdigest()[:32]
    cache.mkdir(parents=True, exist_ok=True)
    stream, header = cache / f"{key}.bin", cache / f"{key}.json"
    if header.is_file() and stream.is_file():
        facts = json.loads(header.read_text())
        if stream.stat().st_size == facts["count"] * np.dtype(facts["dtype"]).itemsize:
            return TokenFile(stream, facts["count"], facts["dtype"], None)
    dtype = "uint16" if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else "uint32"
    start, count = time.perf_counter(), 0
    partial = stream.with_suffix(f".{os.getpid()}.tmp")
    with open(partial, "wb") as out:
        for ids in token_ids(tokenizer, documents):
            out.write(ids.astype(dtype).tobytes())
            count += len(ids)
    os.replace(partial, stream)
    seconds = time.perf_counter() - start
    written = header.with_suffix(f".{os.getpid()}.tmp")
    written.write_text(json.dumps({"count": count, "dtype": dtype, "data": describe,
                                   "tokenizer": getattr(tokenizer, "name_or_path", ""), "seconds": seconds}))
    os.replace(written, header)
    return TokenFile(stream, count, dtype, seconds)


def content_hash(path: pathlib.Path) -> str:
    """A hash of a file's bytes, or of a directory's files (names and bytes)."""
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        digest.update(str(file.relative_to(path) if file != path else file.name).encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()
