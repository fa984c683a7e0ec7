"""How Inductor's generated code reuses buffers, for the cost model's liveness.

Two rules, both from Inductor's code generation, change what a graph holds at a time:
- In place: a loop kernel writes an output into an input buffer of the same size whose last
  reader it is, when no other part of its fused kernel still reads that input
  (`torch._inductor.scheduler.BaseSchedulerNode.decide_inplace_update`).
- Free list: a buffer Inductor allocated is not freed after its last use but kept for the next
  allocation of the same size and dtype (`torch._inductor.codegen.wrapper.AllocateLine.plan`),
  so it stays live until then. Graph inputs never join the free list; fallback kernels (ops
  Inductor calls as they are, like attention) allocate their own outputs, which join the free
  list once they die. Inductor keeps a buffer for a later kernel only when that keeps its own
  peak estimate at or below the estimate's maximum (`AllocateLine.should_reuse_buffer`); the
  estimate counts, per kernel, every buffer from the kernel that writes it to its last reader,
  with no reuse, and each graph input at what its last reader's index reaches
  (`torch._inductor.memory.estimate_peak_memory`, `get_freeable_input_buf`); each buffer kept
  adds its size to the kernels it is kept across.
"""
from __future__ import annotations

from collections import defaultdict

from picofx.cost.liveness import Fusion, Storages, live_bytes


def reuse_buffers(st: Storages, steps, fusion: Fusion, allocates_itself=frozenset(), free_list: bool = True) -> None:
    """Apply both rules to `st`: reused outputs stop being counted and the buffer they take over
    lives on in their place. `allocates_itself`: the steps that are fallback kernels. In place
    applies to `fusion.in_place` (none when Inductor's `inplace_buffers` is off); `free_list`:
    Inductor's `allow_buffer_reuse`."""
    estimate = _PeakEstimate(st, steps, fusion) if free_list else None
    rewritten = _reuse_dying_inputs(st, steps, fusion)
    if free_list:
        _reuse_freed(st, steps, allocates_itself, rewritten, estimate)


class _PeakEstimate:
    """Inductor's estimate of the bytes live at each kernel, before any reuse, and its rule for
    keeping a freed buffer until a later kernel allocates one of the same size."""

    def __init__(self, st: Storages, steps, fusion: Fusion):
        counted = [c or i in st.kernel_local for i, c in enumerate(st.counted)]
        live, _ = live_bytes(st, steps, None, counted, _input_sizes_as_read(st, steps, fusion.read_elements))
        self.kernel = [fusion.kernel_index[node] for node in steps]
        self.per_kernel = [0] * (max(self.kernel, default=0) + 1)
        for k, bytes_live in zip(self.kernel, live):
            self.per_kernel[k] = max(self.per_kernel[k], bytes_live)
        self.peak = max(self.per_kernel)

    def keep(self, size: int, freed_at: int, wanted_at: int) -> bool:
        """Whether a buffer freed after step `freed_at` is kept for an allocation at `wanted_at`."""
        first, stop = self.kernel[freed_at] + 1, self.kernel[wanted_at]
        if first >= stop:
            return True
        if size + max(self.per_kernel[first:stop]) > self.peak:
            return False
        for k in range(first, stop):
            self.per_kernel[k] += size
        return True


def _input_sizes_as_read(st: Storages, steps, read_elements: dict) -> list[int]:
    """Storage sizes, with each input that a loop kernel reads last taken at what that kernel's
    index covers: Inductor sizes a graph input by its last reader's memory dependency, which
    counts the loop dims its index uses (none of a broadcast's; all of a reshape's that needs
    floor division, as a repeat of heads read through a view does)."""
    size, elements = list(st.size), defaultdict(list)
    for k, reads in enumerate(st.reads):
        for i in reads & st.inputs:
            if st.runs_at[k] == st.last_use[i] and (steps[k], st.input_of[i]) in read_elements:
                elements[i].append(read_elements[(steps[k], st.input_of[i])])
    for i, counts in elements.items():
        size[i] = max(counts) * st.dtype[i].itemsize
    return size


def _read_by_kernel_mates(st: Storages, steps, kernel_end: dict) -> dict[int, set[int]]:
    """Per step in a fused kernel, the storages read by the kernel's other members, except by
    those that feed this step."""
    index = {node: k for k, node in enumerate(steps)}
    kernels: dict = defaultdict(list)
    for node, end in kernel_end.items():
        kernels[end].append(index[node])
    shared = {}
    for members in kernels.values():
        first = min(members)
        for k in members:
            feeding, stack = set(), [steps[k]]
            while stack:
                for arg in stack.pop().all_input_nodes:
                    if index.get(arg, -1) >= first and arg not in feeding:
                        feeding.add(arg)
                        stack.append(arg)
            shared[k] = set().union(*(st.reads[m] for m in members if m != k and steps[m] not in feeding))
    return shared


def _take_over(st: Storages, new: int, old: int) -> None:
    """Storage `new` is written into `old`: `old` lives as long as `new` would have."""
    st.counted[new] = False
    st.last_use[old] = st.last_use[new]
    if new in st.kept:
        st.kept.add(old)


def _reuse_dying_inputs(st: Storages, steps, fusion: Fusion) -> set[int]:
    """Returns the storages that took an output in place."""
    shared = _read_by_kernel_mates(st, steps, fusion.kernel_end)
    taken_by: dict[int, int] = {}

    def buffer(i: int) -> int:
        while i in taken_by:
            i = taken_by[i]
        return i

    for k, node in enumerate(steps):
        if node not in fusion.in_place:
            continue
        dying = [j for j in sorted({buffer(j) for j in st.reads[k]})
                 if st.last_use[j] == st.runs_at[k] and j not in st.kept and st.counted[j]
                 and j not in shared.get(k, ())]
        for i in st.allocates[k]:
            j = next((j for j in dying if st.size[j] == st.size[i]), None) if st.counted[i] else None
            if j is not None:
                dying.remove(j)
                taken_by[i] = j
                _take_over(st, i, j)
    return set(taken_by.values())


def _reuse_freed(st: Storages, steps, allocates_itself, rewritten: set[int], estimate: _PeakEstimate) -> None:
    """`rewritten`: storages an output took over in place; an input among them is then freed
    as that output, onto the free list."""
    frees_at: dict[int, list[int]] = defaultdict(list)
    for i, k in enumerate(st.last_use):
        if st.counted[i] and i not in st.kept and (i not in st.inputs or i in rewritten):
            frees_at[k].append(i)
    free_list: dict[tuple, list[int]] = defaultdict(list)  # (size, dtype) -> storages, last freed last
    for k, node in enumerate(steps):
        for i in st.allocates[k] if node not in allocates_itself else ():
            key = (st.size[i], st.dtype[i])
            if not st.counted[i] or not free_list[key]:
                continue
            j = free_list[key][-1]
            if not estimate.keep(st.size[i], st.last_use[j], k):
                continue
            free_list[key].pop()
            _take_over(st, i, j)
            if j not in st.kept:
                frees_at[st.last_use[j]].append(j)
        for j in frees_at.pop(k, ()):
            if st.counted[j] and st.last_use[j] == k:
                free_list[(st.size[j], st.dtype[j])].append(j)
