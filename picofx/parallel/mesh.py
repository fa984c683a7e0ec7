"""The parallel mesh: the ranks of a run laid out on named dimensions over a torch DeviceMesh.

Dimensions, outermost first: "pp" (pipeline stages), "dp_replicate" (data-parallel replicas that
hold every parameter), "dp_shard" (data-parallel ranks that shard parameters), "cp" (context
parallel: each rank holds a part of every sequence), "tp" (tensor parallel). A run uses the
dimensions whose size is above 1. Process groups are resolved here and
nowhere else: a pass asks `resolve_dim` for the dimension it works over.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

from picofx.errors import DistributedError

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
ALIASES = {"dp": "dp_replicate"}  # the name DeviceMeshes written for picofx's pipeline used


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def require_process_group(who: str) -> None:
    if not initialized():
        raise DistributedError(
            f"{who} communicates over a process group, and there is none: launch with torchrun and call "
            "torch.distributed.init_process_group() before picofx.optimize (torchrun --nproc-per-node N script.py).")


@dataclass(frozen=True)
class MeshDim:
    """One dimension of the mesh as a pass sees it: its ranks' process group (None in a single
    process), its size, this rank's place on it, and a one-dimensional DeviceMesh over it (for
    DTensor placements; None where the dimension was given as a bare process group)."""

    name: str
    size: int
    rank: int
    group: Any = None
    device_mesh: Any = None

    @property
    def group_name(self) -> str:
        return self.group.group_name

    def as_device_mesh(self, device_type: str):
        """A one-dimensional DeviceMesh over this dimension (made from its group where it was given
        as a bare ProcessGroup): the mesh of the DTensors placed on it."""
        if self.device_mesh is not None:
            return self.device_mesh
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(self.group, device_type, mesh_dim_names=(self.name,))

    def ranks(self) -> list[int]:
        """The global ranks of this dimension's group, in its order."""
        if self.group is None:
            return [0]
        return dist.get_process_group_ranks(self.group)


@dataclass(frozen=True)
class ParallelMesh:
    """The run's layout: a size per dimension (their product is the world size) and, under
    torch.distributed, the DeviceMesh over them."""

    sizes: tuple[tuple[str, int], ...]
    device_mesh: Any = None

    @classmethod
    def build(cls, *, pp: int = 1, dp_replicate: int = 1, dp_shard: int = 1, cp: int = 1, tp: int = 1,
              device_type: str = "cpu", world: int | None = None) -> "ParallelMesh":
        """A mesh of these sizes; one size may be -1 (the ranks left over). Under torch.distributed
        the product must equal the world size, and the DeviceMesh is made (a collective: every
        rank builds the same mesh). `world` alone, in one process, describes a layout for that many
        ranks (the planner's, the composability table's) without a DeviceMesh."""
        sizes = {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp}
        if world is None:
            world = dist.get_world_size() if initialized() else 1
        sizes = fill_rest(sizes, world)
        if math.prod(sizes.values()) != world:
            layout = " x ".join(f"{name} {size}" for name, size in sizes.items() if size > 1) or "one rank"
            raise DistributedError(f"the parallel layout {layout} needs {math.prod(sizes.values())} ranks, "
                                   f"but the world has {world}; launch {math.prod(sizes.values())} processes "
                                   "or change the layout so its product is the world size.")
        running = dist.get_world_size() if initialized() else 1
        if running > 1 and world != running:
            raise DistributedError(f"ParallelMesh.build(world={world}) under torch.distributed with {running} ranks; "
                                   "leave world out, or give the world size the job runs with.")
        device_mesh = None
        if world > 1 and world == running:
            from torch.distributed.device_mesh import init_device_mesh

            device_mesh = init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
        return cls(tuple(sizes.items()), device_mesh)

    @classmethod
    def from_device_mesh(cls, mesh) -> "ParallelMesh":
        """A user's DeviceMesh with named dimensions (picofx's names, or "dp" for dp_replicate);
        dimensions it lacks have size 1."""
        names = [ALIASES.get(n, n) for n in (mesh.mesh_dim_names or ())]
        unknown = [n for n in names if n not in DIMS]
        if not names or unknown:
            raise DistributedError(f"the DeviceMesh's dimensions {mesh.mesh_dim_names} must be named from "
                                   f"{DIMS} (e.g. init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp_shard', 'tp'))).")
        if mesh.size() != (dist.get_world_size() if initialized() else 1):
            raise DistributedError(f"the DeviceMesh has {mesh.size()} ranks, the world "
                                   f"{dist.get_world_size() if initialized() else 1}; give a mesh over every rank.")
        own = dict(zip(names, mesh.mesh.shape))
        return cls(tuple((name, int(own.get(name, 1))) for name in DIMS), mesh)

    @classmethod
    def single(cls) -> "ParallelMesh":
        return cls(tuple((name, 1) for name in DIMS))

    @property
    def world(self) -> int:
        return math.prod(size for _, size in self.sizes)

    def size(self, name: str) -> int:
        return dict(self.sizes)[check_name(name)]

    def used(self) -> tuple[str, ...]:
        return tuple(name for name, size in self.sizes if size > 1)

    def dim(self, name: str) -> MeshDim:
        """Dimension `name` as a MeshDim (size 1 and no group where the run does not use it)."""
        size = self.size(name)
        if self.device_mesh is None or name not in self._mesh_names():
            return MeshDim(name, size, 0)
        sub = self.device_mesh[self._mesh_name(name)]
        return MeshDim(name, size, sub.get_local_rank(), sub.get_group(), sub)

    def sub_mesh(self, *names: str):
        """The DeviceMesh over dimensions `names` (in the mesh's order): the mesh of DTensors placed
        on several dimensions (a sharded tensor-parallel parameter's (dp_shard, tp))."""
        return self.device_mesh[tuple(self._mesh_name(check_name(n)) for n in names)]

    def joined(self, *names: str) -> MeshDim:
        """Dimensions `names` (in the mesh's order) as one: their ranks in one group, as torchtitan's
        dp_shard_cp (the ranks Shard spans beside context parallelism). Those of size 1 drop out;
        one left is `dim(name)` itself."""
        kept = [check_name(n) for n in DIMS if n in {check_name(m) for m in names} and self.size(n) > 1]
        if len(kept) < 2:
            return self.dim(kept[0] if kept else check_name(names[0]))
        name = "_".join(kept)
        if self.device_mesh is None:
            return MeshDim(name, math.prod(self.size(n) for n in kept), 0)
        flat = self.device_mesh[tuple(self._mesh_name(n) for n in kept)]._flatten(name)
        return MeshDim(name, flat.size(), flat.get_local_rank(), flat.get_group(), flat)

    @staticmethod
    def placement_mesh(*dims: MeshDim):
        """The DeviceMesh over `dims` (each a dimension, or a joined one, of the same run's mesh), in
        the order given: where DTensors placed on several of them live ((dp_shard_cp, tp))."""
        from torch.distributed.device_mesh import DeviceMesh

        if any(d.device_mesh is None for d in dims):
            raise DistributedError("a DTensor placement over " + " x ".join(d.name for d in dims) + " needs the "
                                   "run's DeviceMesh: pass optimize(..., "
                                   "mesh=picofx.parallel.ParallelMesh.build(...)).")
        return dims[0].device_mesh if len(dims) == 1 else DeviceMesh._concatenate([d.device_mesh for d in dims])

    def rank_lists(self, name: str) -> list[list[int]]:
        """The global ranks along dimension `name`, one list per position on the other dimensions."""
        if self.device_mesh is None:
            return [[0]]
        names = [ALIASES.get(n, n) for n in self.device_mesh.mesh_dim_names]
        ranks = self.device_mesh.mesh.movedim(names.index(check_name(name)), -1)
        return ranks.reshape(-1, self.size(name)).tolist()

    def describe(self) -> str:
        return " x ".join(f"{name} {size}" for name, size in self.sizes if size > 1) or "one rank"

    def _mesh_names(self) -> list[str]:
        return [ALIASES.get(n, n) for n in (self.device_mesh.mesh_dim_names or ())]

    def _mesh_name(self, name: str) -> str:
        return self.device_mesh.mesh_dim_names[self._mesh_names().index(name)]


def check_name(name: str) -> str:
    name = ALIASES.get(name, name)
    if name not in DIMS:
        raise DistributedError(f"unknown mesh dimension {name!r}; the dimensions are {DIMS}.")
    return name


def fill_rest(sizes: Mapping[str, int], world: int) -> dict[str, int]:
    """`sizes` with its one -1 replaced by the ranks the others leave."""
    rest = [name for name, size in sizes.items() if size == -1]
    if len(rest) > 1:
        raise DistributedError(f"only one mesh dimension may take the ranks left over (-1), got {rest}.")
    if any(size < 1 and size != -1 for size in sizes.values()):
        raise DistributedError(f"mesh sizes are positive (or -1 for the rest), got {dict(sizes)}.")
    sizes = dict(sizes)
    if rest:
        known = math.prod(size for size in sizes.values() if size != -1)
        if world % known:
            fixed = " x ".join(f"{name} {size}" for name, size in sizes.items() if size > 1)
            raise DistributedError(f"the world of {world} ranks does not divide into groups of {known} ({fixed}); "
                                   f"launch a multiple of {known} processes or change the layout.")
        sizes[rest[0]] = world // known
    return sizes


def mesh_for(requests: list[tuple[tuple[str, ...], int | None]], device_type: str) -> ParallelMesh | None:
    """The run's mesh when the user gave none: each pass asks for its dimensions (and the size of
    its first one, where it needs a size: a pipeline's stages); the first dimension asked for
    without a size, data-parallel first, takes the ranks left over (dp_replicate where none is:
    replicas of the rest). None in a single process, or where no pass asks."""
    if not initialized() or not any(dims for dims, _ in requests):
        return None
    sizes = {name: 1 for name in DIMS}
    for dims, size in requests:
        if dims and size is not None:
            sizes[dims[0]] = size
    asked = {name for dims, _ in requests for name in dims}
    rest = next((name for name in ("dp_shard", "dp_replicate", "cp", "tp") if name in asked and sizes[name] == 1),
                "dp_replicate")
    if sizes[rest] == 1:
        sizes[rest] = -1
    return ParallelMesh.build(**sizes, device_type=device_type)


def root_of_sub_meshes(specs) -> Any:
    """The DeviceMesh that the DeviceMeshes among `specs` (what the passes were given: names,
    ProcessGroups, DeviceMeshes) were sliced from, as FSDP2 and DTensor users write them
    (`mesh["dp"]`, `mesh["tp"]`); None where no sub-mesh is given, or where the mesh's dimensions
    are not named as picofx's (each pass then works on its own sub-mesh alone)."""
    roots = {id(root): root for spec in specs if hasattr(spec, "_get_root_mesh")
             for root in [spec._get_root_mesh()] if root is not spec}
    if len(roots) > 1:
        raise DistributedError("the passes were given sub-meshes of different DeviceMeshes; slice every pass's "
                               "mesh from one (mesh['dp_shard'], mesh['tp']) or pass optimize(..., mesh=...).")
    root = next(iter(roots.values()), None)
    names = [ALIASES.get(n, n) for n in (getattr(root, "mesh_dim_names", None) or ())]
    return root if names and all(n in DIMS for n in names) else None


def resolve_dim(spec, mesh: ParallelMesh | None, default: str, who: str) -> MeshDim:
    """The dimension a pass works over. `spec` is what the user gave the pass: None (the run's
    mesh's `default` dimension, or every rank where the run has no mesh), a dimension name, a
    one-dimensional DeviceMesh, or a ProcessGroup."""
    if isinstance(spec, str):
        if mesh is None:
            raise DistributedError(f"{who}: mesh dimension {spec!r} named, but the run has no mesh; pass "
                                   "picofx.optimize(..., mesh=...) or a DeviceMesh to the pass.")
        return mesh.dim(spec)
    if spec is None:
        if mesh is not None and mesh.world > 1:
            return mesh.dim(default)
        require_process_group(who)
        spec = dist.group.WORLD
    if hasattr(spec, "mesh_dim_names"):  # a DeviceMesh
        if spec.ndim != 1:
            raise DistributedError(f"{who}: a {spec.ndim}-dimensional DeviceMesh was given; give one dimension "
                                   f"(mesh['{default}']) or put the mesh on the run: optimize(..., mesh=...).")
        name = ALIASES.get((spec.mesh_dim_names or (default,))[0], default)
        return MeshDim(name, spec.size(), spec.get_local_rank(), spec.get_group(), spec)
    if isinstance(spec, dist.ProcessGroup):
        return MeshDim(default, dist.get_world_size(spec), dist.get_rank(spec), spec)
    raise TypeError(f"{who}: give a mesh dimension name, a DeviceMesh or a ProcessGroup, got {spec!r}.")


@dataclass(frozen=True)
class PipelineDims:
    """The dimensions a pipeline runs on: its stages' ranks, the data-parallel replicas of each
    stage (None where there are none), and every replica's pipeline as global ranks in stage order
    (None where the pipeline was given as a bare process group)."""

    pp: MeshDim
    dp: MeshDim | None
    pipelines: list[list[int]] | None
    mesh: ParallelMesh | None = None  # the mesh they come from, where there is one


def pipeline_dims(spec, mesh: ParallelMesh | None, stages: int) -> PipelineDims:
    """Where a pipeline of `stages` ranks runs: `spec` as the pass was given it (None, a
    ProcessGroup, a DeviceMesh with a "pp" dimension, or the name "pp"), else the run's mesh, else
    the whole world, which must then hold exactly `stages` ranks."""
    require_process_group("the pipeline pass")
    sliced = getattr(spec, "_get_root_mesh", None) and mesh is not None and spec._get_root_mesh() is mesh.device_mesh
    if (spec is None or sliced) and mesh is not None and mesh.size("pp") > 1:  # mesh["pp"]: the run's mesh's
        spec = mesh
    elif hasattr(spec, "mesh_dim_names") and spec.ndim > 1:
        if "pp" not in (spec.mesh_dim_names or ()):
            raise DistributedError(f"Pipeline: the DeviceMesh has dimensions {spec.mesh_dim_names}; it needs one "
                                   "named 'pp'.")
        spec = ParallelMesh.from_device_mesh(spec)
    if isinstance(spec, ParallelMesh):
        pp = spec.dim("pp")
        replicas = [name for name in ("dp_replicate", "dp_shard") if spec.size(name) > 1]
        dims = PipelineDims(pp, spec.dim(replicas[0]) if len(replicas) == 1 else None, spec.rank_lists("pp"), spec)
    elif spec is None:
        world = dist.get_world_size()
        if world != stages:
            raise DistributedError(
                f"Pipeline: the world has {world} ranks but the pipeline {stages} stages; "
                + (f"put a mesh with pp={stages} on the run (optimize(..., mesh=picofx.parallel.ParallelMesh"
                   f".build(pp={stages}, dp_replicate=-1))) to run {world // stages} data-parallel replicas."
                   if world % stages == 0 else f"the world size must be a multiple of {stages}."))
        dims = PipelineDims(MeshDim("pp", world, dist.get_rank(), dist.group.WORLD), None, [list(range(world))])
    else:
        dims = PipelineDims(resolve_dim(spec, mesh, "pp", "the pipeline pass"), None, None)
    if dims.pp.size != stages:
        raise DistributedError(f"Pipeline: the pipeline group has {dims.pp.size} ranks for {stages} stages per "
                               "rank set; they must be equal.")
    return dims


def subgroups(rank_lists: list[list[int]]) -> list:
    """A process group for each list of ranks; this rank's groups (None where it is in none).
    Every rank must call it with the same lists, in the same order (a collective)."""
    me = dist.get_rank()
    made = [dist.new_group(ranks) for ranks in rank_lists]
    return [group if me in ranks else None for group, ranks in zip(made, rank_lists)]


def one_process_group() -> None:
    """A one-rank gloo group where none exists, so that a tool run as one process (`picofx dump`)
    can show the graphs of a pass that communicates."""
    if not initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def measured_on_first_rank(measure, count: int, dim: MeshDim | None = None) -> list[float]:
    """`count` numbers that `measure()` returns on the first rank of `dim` (None: the world), sent
    to every other rank, so that ranks decide from the same measurement, taken on a rank no other
    competes with for the machine; `measure()` itself where no process group runs. Every rank of
    the dimension must call it."""
    if not initialized():
        return measure()
    group = dim.group if dim is not None else None
    first = dist.get_global_rank(group, 0) if group is not None else 0
    values = torch.tensor(measure() if dist.get_rank() == first else [0.0] * count, dtype=torch.float64)
    dist.broadcast(values, src=first, group=group)
    return values.tolist()
