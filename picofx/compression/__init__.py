"""Gradient compression: the codecs overlap's all-reduce and shard's reduce-scatter write into the
backward graph, and their state."""
