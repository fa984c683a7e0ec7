"""Values that only extern kernels read, and how Inductor computes them, for `picofx.cost.inductor.kernel_order`.

Inductor computes a pointwise value when a reader needs it in memory. A value only extern
kernels (matmuls, attention, custom ops) read gets its buffer only when the first of them is
lowered, so its kernel runs just before that reader. An extern kernel with a layout constraint
(attention) instead copies the value into a buffer of its own, looping over the view it takes
(`ExternKernel.require_strides`): two attentions reading one value each get a copy, unless the
value loads several buffers, when Inductor computes it once (`StorageBox.realize_hint`).
"""
from __future__ import annotations

from collections import defaultdict

from torch import fx

from picofx.cost.inductor.fused_buffers import REDUCTIONS, VIEWS, is_fallback, is_loop_kernel
from picofx.cost.liveness import Schedule, tensor_values


def copies_unrealized_inputs(node: fx.Node) -> bool:
    """A fallback kernel with a layout constraint (attention): lowering it copies each input that
    is not yet in a buffer into a buffer of its own (`ExternKernel.require_strides`), so a value
    that is computed only for such readers is computed once per reader."""
    from torch._inductor.lowering import maybe_layout_constraints

    return is_fallback(node) and maybe_layout_constraints(node.target) is not None


def loaded_buffers(node: fx.Node, in_registers) -> set[fx.Node]:
    """The buffers the code computing `node` loads elements of (through views and the values it
    inlines), leaving out scalars, which Inductor loads at a constant index."""
    loads = set()
    for arg in node.all_input_nodes:
        while arg.target in VIEWS and arg.args and isinstance(arg.args[0], fx.Node):
            arg = arg.args[0]
        if arg in in_registers:
            loads |= loaded_buffers(arg, in_registers)
        elif arg.op != "get_attr" and getattr(arg.meta.get("val"), "numel", lambda: 0)() > 1:
            loads.add(arg)
    return loads


def realized_by_reader(schedule: Schedule, in_registers) -> tuple[Schedule, dict[fx.Node, tuple], dict]:
    """The schedule with each pointwise value that only extern kernels read moved to just before
    the first of them, where Inductor computes it (module doc); and, for such a value whose
    readers all copy it (`copies_unrealized_inputs`) and that Inductor leaves unrealized, the
    readers that get a copy of their own besides its buffer: all but the last. Inductor
    fuses the copies into one kernel (they load the same inputs alike), so each is allocated
    with the first and lives until its reader. Third, the loop shape of each value computed as
    such a copy: the shape of the view its reader takes, not its own."""
    late: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    copies, loop_shapes = {}, {}
    index = {node: k for k, node in enumerate(schedule.steps)}
    returned = {n for n in schedule.outputs if n is not None}
    for node in schedule.steps:
        if is_loop_kernel(node, in_registers) and node.target not in REDUCTIONS:
            readers = sorted(_readers(node, index, returned) or (), key=index.__getitem__)
            copied = readers and all(map(copies_unrealized_inputs, readers))
            if (len(readers) == 1 and is_fallback(readers[0])) or copied:
                late[readers[0]].append(node)
            if copied and (len(readers) == 1 or not _realized_by_hint(node, in_registers)):
                copies[node] = tuple(readers[:-1])
                loop_shapes[node] = _shape_read_by(node, readers[0])
    copies = {node: readers for node, readers in copies.items() if readers}
    if not late:
        return schedule, copies, loop_shapes
    moved = {n for nodes in late.values() for n in nodes}
    ordered = []
    for node in schedule.steps:
        ordered.extend(late.get(node, ()))
        if node not in moved:
            ordered.append(node)
    return Schedule(schedule.inputs, ordered, schedule.outputs), copies, loop_shapes


def _shape_read_by(node: fx.Node, reader: fx.Node) -> tuple:
    """The shape of the value, or of the view of it, that `reader` takes as its argument."""
    views, stack = {node}, [node]
    while stack:
        for user in stack.pop().users:
            if user.target in VIEWS and user not in views:
                views.add(user)
                stack.append(user)
    arg = next((a for a in reader.all_input_nodes if a in views), node)
    return tuple(tensor_values(arg.meta.get("val"))[0].shape)


def _realized_by_hint(node: fx.Node, in_registers) -> bool:
    """Whether Inductor computes the value once for its several extern readers: it does when the
    value, or a view of it, has more than one user and an extern kernel among them, and the
    code computing it loads more than one buffer (`StorageBox.realize_hint`, called by
    `GraphLowering.run_node`)."""
    def hinted(n: fx.Node) -> bool:
        return ((len(n.users) > 1 and any(is_fallback(u) for u in n.users))
                or any(hinted(u) for u in n.users if u.target in VIEWS))

    return hinted(node) and len(loaded_buffers(node, in_registers)) > 1


def _readers(node: fx.Node, steps, returned) -> set[fx.Node] | None:
    """The steps that read `node`'s value, through views; None if the schedule returns the value
    or a view of it. (Users outside `steps` belong to the other graph of a joint graph.)"""
    if node in returned:
        return None
    found = set()
    for user in node.users:
        if user in steps and user.target in VIEWS:
            through = _readers(user, steps, returned)
            if through is None:
                return None
            found |= through
        elif user in steps:
            found.add(user)
    return found
