"""shard: sharded data parallel (ZeRO-3) inside the captured step."""
from picofx.passes.shard.shard import Shard

__all__ = ["Shard"]
