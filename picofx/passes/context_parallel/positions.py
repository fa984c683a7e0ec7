"""Which positions of the sequence each context-parallel rank keeps, and the index tensors that
select them, built in the graph from aranges (so the graph needs no constant tensors).

The sequence of T tokens is cut into chunks. With load balancing, 2·cp chunks, rank i keeping
chunks i and 2·cp−1−i (head and tail: under a causal mask every rank then attends over the same
number of keys); without, cp chunks, rank i keeping chunk i. All-gathering the ranks' parts gives
the keys in `key_order`: rank 0's positions, then rank 1's, and so on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

aten = torch.ops.aten


def kept_ranges(length: int, ranks: int, rank: int, load_balance: bool) -> list[tuple[int, int]]:
    """The [start, stop) ranges of positions rank `rank` of `ranks` keeps of a `length`-long sequence."""
    if load_balance:
        chunk = length // (2 * ranks)
        return [(rank * chunk, (rank + 1) * chunk), ((2 * ranks - 1 - rank) * chunk, (2 * ranks - rank) * chunk)]
    chunk = length // ranks
    return [(rank * chunk, (rank + 1) * chunk)]


def check_divisible(length: int, ranks: int, load_balance: bool, where: str) -> None:
    parts = 2 * ranks if load_balance else ranks
    if length % parts:
        fix = (f"pad the sequence to a multiple of {parts}" +
               (f", or ContextParallel(load_balance=False), which needs a multiple of {ranks}" if load_balance else ""))
        raise ValueError(f"ContextParallel: the sequence of {where} has {length} tokens, which the "
                         f"{'2·cp = ' if load_balance else 'cp = '}{parts} {'head-tail chunks' if load_balance else 'ranks'}"
                         f" do not divide; {fix}.")


@dataclass
class Positions:
    """The index nodes of one graph: this rank's kept positions, the gathered keys' positions, and
    flat indices of the kept tokens in a dimension that merges the sequence with others."""

    graph: fx.Graph
    length: int
    ranks: int
    rank: int
    load_balance: bool
    device: torch.device
    anchor: fx.Node  # index nodes go before it (the graph's first computation)
    fake_mode: Any = None
    made: dict = field(default_factory=dict)

    @property
    def local_length(self) -> int:
        return self.length // self.ranks

    def ranges(self, rank: int) -> list[tuple[int, int]]:
        return kept_ranges(self.length, self.ranks, rank, self.load_balance)

    def key_order(self) -> list[int]:
        """The positions of the all-gathered keys, in their gathered order."""
        return [p for r in range(self.ranks) for start, stop in self.ranges(r) for p in range(start, stop)]

    def _call(self, target, *args, **kwargs) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        fake_args, fake_kwargs = fx.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        return node

    def _arange(self, start: int, stop: int) -> fx.Node:
        return self._call(aten.arange.start, start, stop, dtype=torch.int64, device=self.device)

    def _of_ranges(self, ranges) -> fx.Node:
        pieces = [self._arange(start, stop) for start, stop in ranges]
        return pieces[0] if len(pieces) == 1 else self._call(aten.cat.default, pieces)

    def kept(self) -> fx.Node:
        """(T / cp,) this rank's positions, in the order its tokens are laid out."""
        if "kept" not in self.made:
            self.made["kept"] = self._of_ranges(self.ranges(self.rank))
        return self.made["kept"]

    def keys(self) -> fx.Node:
        """(T,) the positions of the all-gathered keys."""
        if "keys" not in self.made:
            self.made["keys"] = self._of_ranges([r for rank in range(self.ranks) for r in self.ranges(rank)])
        return self.made["keys"]

    def restore(self) -> fx.Node:
        """(T,) where each position lies among the gathered keys: gathered[restore] is in sequence order."""
        if "restore" not in self.made:
            self.made["restore"] = self._call(aten.argsort.default, self.keys())
        return self.made["restore"]

    def causal_mask(self) -> fx.Node:
        """(T / cp, T) True where this rank's query may attend to a gathered key: key position <= query's."""
        if "mask" not in self.made:
            self.made["mask"] = self._call(aten.le.Tensor, self._call(aten.unsqueeze.default, self.keys(), 0),
                                           self._call(aten.unsqueeze.default, self.kept(), 1))
        return self.made["mask"]

    def flat(self, outer: int, inner: int) -> fx.Node:
        """The kept tokens' indices in a dimension of outer·T·inner entries (the sequence merged with
        `outer` entries before it and `inner` after it, as a (batch·sequence) view lays them out)."""
        key = ("flat", outer, inner)
        if outer == inner == 1:
            return self.kept()
        if key not in self.made:
            index = self.kept()
            if inner > 1:  # (T/cp, inner): position·inner + i
                index = self._call(aten.add.Tensor, self._call(aten.unsqueeze.default,
                                                                self._call(aten.mul.Tensor, index, inner), 1),
                                   self._arange(0, inner))
                index = self._call(aten.view.default, index, [-1])
            if outer > 1:  # (outer, T/cp·inner): o·T·inner + ...
                starts = self._call(aten.mul.Tensor, self._arange(0, outer), self.length * inner)
                index = self._call(aten.add.Tensor, self._call(aten.unsqueeze.default, starts, 1),
                                   self._call(aten.unsqueeze.default, index, 0))
                index = self._call(aten.view.default, index, [-1])
            self.made[key] = index
        return self.made[key]
