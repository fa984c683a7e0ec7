"""Gradient compression: one codec protocol (protocol.py) that the overlap pass's all-reduces and
the shard pass's reduce-scatters both call, the codecs (dense, int8, topk, powersgd, sparse_rows),
their state between steps (state.py), the int8 start of PowerSGD (start.py), the `compress`
spelling (parse.py) and the list of codecs it names (registry.py)."""
from picofx.compression.dense import Dense
from picofx.compression.int8 import Int8
from picofx.compression.parse import KINDS, CompressSpec, parse_compress
from picofx.compression.powersgd import PowerSGD
from picofx.compression.protocol import Bucket, Codec, Emitter, Pending, drain, finish, issue
from picofx.compression import registry
from picofx.compression.sparse_rows import Rows, SparseRows, embedding_rows, rows_or_dense
from picofx.compression.start import START_STEPS, Start, start_of
from picofx.compression.state import CompressionState
from picofx.compression.topk import TopK

__all__ = ["KINDS", "START_STEPS", "Start", "start_of", "Bucket", "Codec", "CompressSpec", "CompressionState", "Dense",
           "Emitter", "Int8", "Pending",
           "PowerSGD", "Rows", "SparseRows", "TopK", "drain", "embedding_rows", "finish", "issue", "parse_compress",
           "rows_or_dense"]
