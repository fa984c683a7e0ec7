"""picofx train takes every cell of the composability table (picofx/manager/combinations.py) from its
flags: a working cell parses into passes and a mesh that are that cell; a refused one stops before
any process group with the table's reason (exit status 2, one line)."""
from __future__ import annotations

import pytest

from picofx.cli.train_args import parse_args
from picofx.cli.train_layout import train_recipe
from picofx.manager import combinations
from picofx.manager.combinations import Cell
from picofx.parallel import ParallelMesh


def flags(cell: Cell) -> list[str]:
    """The picofx train options that ask for `cell`."""
    f, out = cell.features, []
    if "overlap" in f:
        out += ["--dp", "2"]
    if "shard" in f:
        out += ["--shard"] + (["--dp-replicate", "2"] if "hsdp" in f else [])
        stage = [name[-1] for name in combinations.SHARD_STAGES if name in f]
        out += ["--shard-stage", stage[0]] if stage else []
    if "tensor_parallel" in f:
        out += ["--tp", "2"]
    if "sequence_parallel" in f:
        out += ["--sequence-parallel"] + ([] if "async_tp" in f else ["--no-async-tp"])
    if "pipeline" in f:
        out += ["--pp", "2", "--microbatches", "2"]
    if "context_parallel" in f:
        out += ["--cp", "2"] + (["--cp-method", "ring"] if "ring" in f else [])
    out += ["--compress", cell.compress] if cell.compress else []
    out += ["--float8", "tensorwise", "--float8-layers", "all"] if "float8" in f else []
    compute = [name for name in combinations.COMPUTE if name in f and name != "float8"]
    return out + ["--passes", *compute]  # none: not even the default fuse


def torchrun(world: int) -> dict:
    return {"RANK": "0", "WORLD_SIZE": str(world)} if world > 1 else {}


@pytest.mark.parametrize("cell", [c for c in combinations.cells() if c.works], ids=lambda c: c.describe())
def test_a_working_cell_parses_into_its_passes_and_mesh(cell):
    args = parse_args(flags(cell), environ=torchrun(cell.world))
    assert args.world == cell.world
    made = train_recipe(args)
    mesh = ParallelMesh(tuple(made.mesh_shape.items()))
    assert combinations.features_of(made.passes, mesh) == cell.features
    assert {k: v for k, v in made.mesh_shape.items() if v > 1} == cell.mesh


@pytest.mark.parametrize("cell", [c for c in combinations.cells() if not c.works], ids=lambda c: c.describe())
def test_a_refused_cell_stops_with_the_table_s_reason(cell, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(flags(cell), environ=torchrun(cell.world))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert (cell.refusal.raised or cell.refusal.reason) in err, err
