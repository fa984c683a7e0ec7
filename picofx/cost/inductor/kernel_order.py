"""The order in which Inductor runs a graph's kernels, for the cost model's liveness.

Inductor's scheduler fuses two loop kernels (pointwise or reduction nodes that write a buffer)
when they have the same iteration size and touch a common buffer alike (both load it with the
same index over the same loop, or one writes what the other reads: `picofx.cost.inductor.loop_loads`), unless
a node outside the pair depends on one and feeds the other (the fusion would make a cycle).
It then sorts the fused kernels by their first member's place and moves what each depends on
before it. So a fused kernel runs where its first member stood, all its outputs are live at
once and its inputs until it ends: fusing two kernels that read the same buffer far apart (a
recomputed activation and a gradient, say) can raise the peak above the graph order's. The
rules follow `torch._inductor.scheduler` (`get_possible_fusions`, `can_fuse`,
`will_fusion_create_cycle`, `are_long_distant_nodes`, `topological_sort_schedule`), with its
limits on how far apart two readers of a buffer may be, on how far apart (in kernels) two fused
kernels may start and end, and on how many nodes one kernel may hold, read from Inductor's config
(`picofx.cost.inductor.switches`).

Where a kernel stands: Inductor computes a pointwise value when a reader needs it in memory.
A value with several readers gets its buffer where it is defined; a value only extern kernels
read is computed just before the first of them, or copied for each (`picofx.cost.inductor.extern_readers`).
"""
from __future__ import annotations

import operator
from collections import defaultdict
from functools import partial

import torch
from networkx.utils import UnionFind
from torch import fx

from picofx.cost.inductor.buffer_reuse import reuse_buffers
from picofx.cost.inductor.extern_readers import realized_by_reader
from picofx.cost.inductor.fused_buffers import (REDUCTIONS, VIEWS, in_place_candidates, is_fallback, is_loop_kernel,
                                  unmaterialized)
from picofx.cost.liveness import Fusion, Schedule, storage_bytes, tensor_values
from picofx.cost.inductor.loop_loads import LoopAccess, output_size
from picofx.cost.inductor.switches import InductorSwitches

aten = torch.ops.aten
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int}  # Inductor lowers them to views


def _iteration_shape(node: fx.Node) -> tuple:
    source = node.args[0] if node.target in REDUCTIONS and isinstance(node.args[0], fx.Node) else node
    values = tensor_values(source.meta.get("val"))
    return tuple(values[0].shape) if values else ()


def _inlined(steps, in_registers) -> set[fx.Node]:
    """Steps that are no kernel of their own: values in registers and views (a split and the
    pieces taken from it are views too)."""
    return set(in_registers) | {n for n in steps if n.target in VIEWS or n.target in SPLITS
                                or (n.target is operator.getitem and n.args[0].target in SPLITS)}


def _scheduler_ranks(steps, transparent, in_registers) -> dict[fx.Node, int]:
    """Each kernel's place in Inductor's list of scheduler nodes, which `are_long_distant_nodes`
    measures in: a `cat` is a no-op node after one copy kernel per input that is not a loop
    kernel of its own (those write into the output directly)."""
    ranks, rank = {}, 0
    for node in steps:
        if node in transparent:
            continue
        if node.target is aten.cat.default:
            rank += sum(not is_loop_kernel(arg, in_registers) for arg in node.all_input_nodes)
        ranks[node] = rank
        rank += 1
    return ranks


def loop_access(steps, in_registers, loop_shapes=None) -> LoopAccess:
    """How the loop kernels among `steps` access their buffers; `loop_shapes`: kernels whose loop
    is not their value's shape (`realized_by_reader`)."""
    transparent = _inlined(steps, in_registers)
    loops = [n for n in steps if is_loop_kernel(n, in_registers)]
    loop_shapes = loop_shapes or {}
    return LoopAccess(loops, lambda n: loop_shapes.get(n) or _iteration_shape(n), transparent,
                      {n for n in transparent if n not in in_registers})


def fused_kernels(schedule: Schedule, in_registers, access: LoopAccess | None = None,
                  switches: InductorSwitches | None = None) -> list[list[fx.Node]]:
    """Groups of steps Inductor runs as one kernel (only groups of two or more), each in step order."""
    switches = switches or InductorSwitches.current()
    window = switches.pairwise_attempts
    steps = schedule.steps
    index = {node: k for k, node in enumerate(steps)}
    transparent = _inlined(steps, in_registers)
    access = access or loop_access(steps, in_registers)
    loops = list(access.reads)
    accessors: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node in loops:
        accessors[node].append(node)
        for buffer in access.reads[node]:
            accessors[buffer].append(node)
    size = access.size

    def compatible(a: fx.Node, b: fx.Node, buffer: fx.Node) -> bool:
        """The same loop, or a reduction and a reader of its result that loops over that result;
        and the two access their common buffer alike (`picofx.cost.inductor.loop_loads`)."""
        if buffer is a and a.target in REDUCTIONS and size[b] == output_size(a):
            return True
        if buffer is a and access.row_wise(a) and access.row_wise(b):
            return size[a] == size[b]
        return size[a] == size[b] and access.alike(a, b, buffer)

    pairs = set()
    for buffer, nodes in accessors.items():
        if storage_bytes(buffer) < switches.score_fusion_memory_threshold:  # too few shared bytes to fuse for
            continue
        for i, a in enumerate(nodes):
            pairs.update((a, b) for b in nodes[i + 1:i + 1 + window] if a is not b and compatible(a, b, buffer))
    groups = UnionFind()
    members = {node: [node] for node in loops}
    between = _kernels_between(steps, transparent)
    kernel_rank = _scheduler_ranks(steps, transparent, in_registers)
    span = {node: (kernel_rank[node], kernel_rank[node]) for node in loops}
    for a, b in sorted(pairs, key=lambda p: (index[p[0]], index[p[1]])):
        ra, rb = groups[a], groups[b]
        if ra is rb or len(members[ra]) + len(members[rb]) > switches.max_fusion_size:
            continue
        (low_a, high_a), (low_b, high_b) = span[ra], span[rb]
        if max(abs(low_a - high_b), abs(low_b - high_a)) > switches.long_distance:
            continue
        union = members[ra] + members[rb]
        if between(union):
            continue
        groups.union(ra, rb)
        members[groups[a]] = union
        span[groups[a]] = (min(low_a, low_b), max(high_a, high_b))
    return [sorted(m, key=index.__getitem__) for root, m in members.items()
            if groups[root] is root and len(m) > 1]


def _kernels_between(steps, transparent):
    """`between(nodes)`: whether a node that is not inlined (an extern kernel, or a loop kernel
    of its own) depends on one of `nodes` and feeds another, so fusing them would make a cycle.
    Ancestors and descendants are bitsets over the steps, computed once per graph. (Inductor
    also counts paths through kernels fused earlier; those are rare and not modelled.)"""
    index = {node: k for k, node in enumerate(steps)}
    above, below = [0] * len(steps), [0] * len(steps)
    for k, node in enumerate(steps):
        for arg in node.all_input_nodes:
            if arg in index:
                above[k] |= above[index[arg]] | 1 << index[arg]
    for k in reversed(range(len(steps))):
        for user in steps[k].users:
            if user in index:
                below[k] |= below[index[user]] | 1 << index[user]
    kernels = sum(1 << k for k, node in enumerate(steps) if node not in transparent)

    def between(nodes) -> bool:
        own = sum(1 << index[n] for n in nodes)
        after = before = 0
        for n in nodes:
            after |= below[index[n]]
            before |= above[index[n]]
        return bool(after & before & kernels & ~own)

    return between


def kernel_order(schedule: Schedule, in_registers, access: LoopAccess | None = None,
                 switches: InductorSwitches | None = None) -> tuple[Schedule, dict[fx.Node, fx.Node], dict[fx.Node, int]]:
    """The schedule reordered as Inductor runs it; for each member of a fused kernel the
    kernel's last member (the step where the kernel ends: its inputs live until there); and for
    each step the number of the kernel it runs in, counting kernels in order. Views and inlined
    values are no kernels of their own: each goes just before its first reader, in its kernel."""
    steps = schedule.steps
    index = {node: k for k, node in enumerate(steps)}
    transparent = _inlined(steps, in_registers)
    unit_of = {node: (node,) for node in steps if node not in transparent}
    for group in fused_kernels(schedule, in_registers, access, switches):
        for node in group:
            unit_of[node] = tuple(group)
    order, emitted, opened, done = [], set(), set(), set()

    def kernel_inputs(node: fx.Node, seen: set) -> set[fx.Node]:
        found = set()
        for arg in node.all_input_nodes:
            if arg in index and arg not in emitted and arg not in seen:
                seen.add(arg)
                found |= kernel_inputs(arg, seen) if arg in transparent else {arg}
        return found

    def emit(node: fx.Node) -> None:  # a node after its views and inlined inputs
        for arg in node.all_input_nodes:
            if arg in transparent and arg in index and arg not in emitted:
                emit(arg)
        emitted.add(node)
        order.append(node)

    for node in steps:  # units by their first member; a unit's dependencies go first
        stack = [(unit_of.get(node), False)] if node not in transparent else []
        while stack:
            unit, expanded = stack.pop()
            if unit in done or (unit in opened and not expanded):  # opened twice: only a cycle does that
                continue
            if expanded:
                done.add(unit)
                for member in unit:
                    emit(member)
                continue
            opened.add(unit)
            stack.append((unit, True))
            deps = {unit_of[a] for n in unit for a in kernel_inputs(n, set())} - done - {unit}
            stack.extend((d, False) for d in sorted(deps, key=lambda u: index[u[0]], reverse=True))
    for node in steps:
        if node not in emitted:
            emit(node)
    last_of = {n: unit[-1] for n, unit in unit_of.items() if len(unit) > 1}
    return Schedule(schedule.inputs, order, schedule.outputs), last_of, _kernel_numbers(order, transparent, unit_of)


def _kernel_numbers(order, transparent, unit_of) -> dict[fx.Node, int]:
    numbers, waiting, unit, number = {}, [], None, -1
    for node in order:
        if node in transparent:
            waiting.append(node)
            continue
        if unit_of[node] != unit:
            unit, number = unit_of[node], number + 1
        for n in (*waiting, node):
            numbers[n] = number
        waiting = []
    numbers.update((n, max(number, 0)) for n in waiting)
    return numbers


def inductor_fusion(schedule: Schedule, switches: InductorSwitches | None = None) -> tuple[Schedule, Fusion]:
    """The schedule in Inductor's order, and how Inductor's kernels and buffers run it, under
    `switches` (default: Inductor's config now)."""
    switches = switches or InductorSwitches.current()
    in_registers = unmaterialized(schedule, switches)
    schedule, copies, loop_shapes = realized_by_reader(schedule, in_registers)
    access = loop_access(schedule.steps, in_registers, loop_shapes)
    ordered, kernel_end, kernel_index = kernel_order(schedule, in_registers, access, switches)
    fallbacks = frozenset(n for n in ordered.steps if is_fallback(n))
    reuse = partial(reuse_buffers, allocates_itself=fallbacks, free_list=switches.allow_buffer_reuse)
    return ordered, Fusion(frozenset(in_registers), frozenset(in_place_candidates(ordered, switches)), kernel_end,
                           reuse, kernel_index,
                           _kernel_local(ordered, in_registers, kernel_end), access.elements_read(schedule.inputs),
                           copies)


def _kernel_local(schedule: Schedule, in_registers, kernel_end: dict) -> frozenset:
    """Members of fused kernels whose every reader is in the same kernel: Inductor drops their
    buffers when it writes the kernel (`Scheduler.remove_kernel_local_buffers`)."""
    steps = set(schedule.steps)
    transparent = _inlined(schedule.steps, in_registers)
    returned = {n for n in schedule.outputs if n is not None}

    def readers(node: fx.Node):
        for user in node.users:
            if user in transparent and user not in returned:
                yield from readers(user)
            else:
                yield user

    return frozenset(n for n, end in kernel_end.items() if n not in returned
                     and all(r in steps and kernel_end.get(r) is end for r in readers(n)))
