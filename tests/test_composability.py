"""The composability table (picofx/manager/combinations.py) is the truth: every cell it says works
trains one step with the loss and gathered gradients equal to one process on the full batch, and
every cell it refuses is refused before capture, with the table's reason.

One spawned group per world size runs all its cells in turn (tests/composability_ranks.py); the
comparisons happen here. Tolerances: fp32 loss rtol 1e-5, gradients rtol 1e-4. Where a cell
rounds on purpose, per gradient tensor normwise (||error|| <= rtol ||expected||): precision (bf16
matmuls) against one process with precision, 2e-2 as in test_overlap; bf16 on the wire 1e-2; int8
(blocks of 256, quantized twice) 3e-2; topk:0.5 and powersgd:8, lossy by design, 0.9 over the
whole model (they keep most of the gradient's norm; their quality is tools/bench_compress.py's),
and every replica must hold the same gradient."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import picofx
from picofx.manager import combinations
from picofx.manager.combinations import Cell, CombinationError
from picofx.parallel import ParallelMesh
from picofx.passes.precision.precision import FLOAT8_TOLERANCE

import composability_ranks
from composability_ranks import cell_passes, tiny
from picofx.parallel.launch import run_ranks

WORKING = [c for c in combinations.cells() if c.works]
REFUSED = [c for c in combinations.cells() if not c.works]
CODEC_RTOL = {"bf16": 1e-2, "int8": 3e-2}
WHOLE_MODEL_RTOL = {"topk": 0.9, "powersgd": 0.9}
# Against one process with the same precision: bf16 matmuls 2e-2; float8's dynamic scales follow
# each rank's activations (a data-parallel replica's or a micro-batch's rows, a context-parallel
# rank's tokens) and tp=2 leaves the MLP (88 wide a rank) in bf16, so ranks cast other values than
# one process: the precision pass's float8 tolerance (measured worst 13%, a k projection's small
# gradient; the loss within 1e-4).
FLOAT8_RTOL = FLOAT8_TOLERANCE[0]
PRECISION_RTOL = {"precision": 2e-2, "float8": FLOAT8_RTOL}
INDUCTOR_CELLS = (frozenset({"overlap", "fuse"}), frozenset({"shard", "tensor_parallel"}))


def one_process(passes: list) -> dict:
    """Loss and gradients of the full batch in one process (with `passes`, else the plain model)."""
    z = tiny()
    if passes:
        opt = picofx.optimize(z.model, z.example_inputs, passes, backend="eager", loss_fn=z.loss_fn)
        loss = opt.forward_backward(**z.example_inputs)
        float8 = sum(r.notes.get("float8_linears", 0) for r in opt.report.records if r.name == "precision")
    else:
        inputs = {k: v for k, v in z.example_inputs.items() if k != "labels"}
        loss = z.loss_fn(z.model(**inputs), z.example_inputs["labels"])
        loss.backward()
        float8 = 0
    return {"loss": loss.detach(), "grads": {n: p.grad.detach().clone() for n, p in z.model.named_parameters()},
            "float8_linears": float8}


class References(dict):
    """One process's loss and gradients by kind ("fp32", "precision", "float8"), each computed on first use."""

    def __missing__(self, kind: str) -> dict:
        passes = {"fp32": [], "precision": ["precision"], "float8": cell_passes(Cell(frozenset({"float8"})))}[kind]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Precision\(float8=...\) on the CPU")
            self[kind] = one_process(passes)
        return self[kind]


@pytest.fixture(scope="module")
def references() -> dict:
    return References()


GROUPS: dict = {}


def group(world: int, slow: bool, backend: str = "eager", selected=None) -> dict:
    """The results of every working cell of this world (CI's or the slow ones), from one spawn;
    `selected`: only these cells (those the session runs, e.g. under `-k shard_stage`)."""
    key = (world, slow, backend)
    if key not in GROUPS:
        cells = [c for c in WORKING if c.world == world and c.slow == slow
                 and (backend == "eager" or c.features in INDUCTOR_CELLS) and (selected is None or c in selected)]
        results = run_ranks(composability_ranks.run_cells, world, cells, backend,
                            timeout=240 + max(60, 15 * world) * len(cells),
                            collective_timeout=90)
        GROUPS[key] = {cell: [r[cell] for r in results] for cell in cells}
    return GROUPS[key]


def normwise_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).double().norm() / expected.double().norm().clamp_min(1e-30)).item()


def assert_matches_one_process(cell: Cell, ranks: list, references: dict) -> None:
    errors = [r["error"] for r in ranks if "error" in r]
    assert not errors, f"{cell.describe()} ({cell.mesh_text()}) failed: {errors[0]}"
    kind = next((k for k in ("float8", "precision") if k in cell.features), "fp32")
    reference = references[kind]
    if "context_parallel" in cell.features:  # each rank (each pipeline stage of it) computed half the tokens
        length = tiny().example_inputs["input_ids"].shape[1]
        assert all(r["tokens_per_rank"] and set(r["tokens_per_rank"]) == {length // 2} for r in ranks), \
            [r["tokens_per_rank"] for r in ranks]
    if {"overlap", "context_parallel"} <= cell.features and not cell.compress:  # one all-reduce sums dp and cp
        assert all(r["overlap_spans"] == ["dp_replicate_cp"] for r in ranks), [r["overlap_spans"] for r in ranks]
    if {"shard", "context_parallel"} <= cell.features and not cell.compress:  # torchtitan's dp_shard_cp
        assert all(r["shard_spans"] == ["dp_shard_cp"] for r in ranks), [r["shard_spans"] for r in ranks]
        if not {"tensor_parallel", "pipeline"} & cell.features:  # each rank holds 1/(dp_shard x cp) of the model
            assert all(abs(r["local_fraction"] - 1 / 4) < 0.01 for r in ranks), [r["local_fraction"] for r in ranks]
    by_replica = {}
    for r in ranks:  # ranks of one replica (its tp and pp ranks) see the same batch and loss
        by_replica.setdefault(r["replica"], r["loss"])
        torch.testing.assert_close(r["loss"], by_replica[r["replica"]], rtol=1e-6, atol=0)
    assert len(by_replica) == ranks[0]["replicas"]
    loss = torch.stack(list(by_replica.values())).mean()
    if "float8" in cell.features:  # float8 ran on every rank (each pipeline stage of it)
        assert all(r["float8_linears"] > 0 for r in ranks), [r["float8_linears"] for r in ranks]
    precise = "precision" not in cell.features
    torch.testing.assert_close(loss, reference["loss"], rtol=1e-5 if precise else 1e-2, atol=1e-6 if precise else 1e-3)
    held = {name for r in ranks for name in r["grads"]}
    assert held == set(reference["grads"]), f"gradients held: {sorted(held ^ set(reference['grads']))}"
    codec = [k for k in combinations.COMPRESSION if k in cell.features and k != "sparse_rows"]
    rtol = max([CODEC_RTOL.get(k, 0.0) for k in codec] + [0.0 if precise else PRECISION_RTOL[kind]])
    for r in ranks:
        for name, g in r["grads"].items():
            expected = reference["grads"][name]
            if codec and codec[0] in WHOLE_MODEL_RTOL:
                continue
            if rtol:
                assert normwise_error(g, expected) <= rtol, (cell.describe(), name, normwise_error(g, expected))
            else:
                torch.testing.assert_close(g, expected, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    if codec and codec[0] in WHOLE_MODEL_RTOL:
        for r in ranks:
            names = sorted(r["grads"])
            error = normwise_error(torch.cat([r["grads"][n].flatten() for n in names]),
                                   torch.cat([reference["grads"][n].flatten() for n in names]))
            assert error <= WHOLE_MODEL_RTOL[codec[0]], (cell.describe(), error)
    if codec:  # a lossy exchange still leaves every replica with the same gradient
        first = {}
        for r in ranks:
            for name, g in r["grads"].items():
                assert torch.equal(first.setdefault(name, g), g), f"{name} differs between replicas"


def cell_id(cell: Cell) -> str:
    return cell.describe().replace(" + ", "+")


def marked(cells: list) -> list:
    return [pytest.param(c, id=cell_id(c), marks=[pytest.mark.slow] if c.slow else []) for c in cells]


@pytest.mark.parametrize("cell", marked([c for c in WORKING if c.world == 1]))
def test_one_process_cell_trains_like_the_model(cell, references):
    assert_matches_one_process(cell, [{**one_process(cell_passes(cell)), "replica": 0, "replicas": 1}], references)


def selected_cells(request) -> set:
    """The cells of the tests this session runs."""
    return {item.callspec.params["cell"] for item in request.session.items
            if "cell" in getattr(getattr(item, "callspec", None), "params", {})}


@pytest.mark.parametrize("cell", marked([c for c in WORKING if c.world > 1]))
def test_working_cell_trains_like_one_process(cell, references, request):
    assert_matches_one_process(cell, group(cell.world, cell.slow, selected=selected_cells(request))[cell], references)


@pytest.mark.slow
@pytest.mark.parametrize("features", INDUCTOR_CELLS, ids=lambda f: "+".join(sorted(f)))
def test_cell_under_inductor(features, references):
    cell = Cell(features)
    assert_matches_one_process(cell, group(cell.world, cell.slow, "inductor")[cell], references)


@pytest.mark.parametrize("cell", [pytest.param(c, id=cell_id(c)) for c in REFUSED])
def test_refused_cell_says_why_before_capture(cell):
    """In this process, with no process group: a refusal comes before capture and any collective."""
    z = tiny()
    calls = []
    z.model.register_forward_pre_hook(lambda *a: calls.append(1))
    refusal = cell.refusal
    with pytest.raises((CombinationError, ValueError)) as raised:
        picofx.optimize(z.model, z.example_inputs, cell_passes(cell), backend="eager", loss_fn=z.loss_fn,
                        mesh=ParallelMesh(tuple(cell.mesh.items())))
    assert (refusal.raised or refusal.reason) in str(raised.value), str(raised.value)
    assert not calls, "the model ran (capture) before the refusal"


def test_the_table_covers_every_pair_and_names_each_refusal():
    cells = combinations.cells()
    for a, b in __import__("itertools").combinations(combinations.FEATURES, 2):
        assert Cell(combinations.closed({a, b})) in cells, (a, b)
    assert all(c.refusal.reason for c in REFUSED)
    assert {c.world for c in WORKING} <= {1, 2, 4, 8, 16}


def test_check_combination_reads_pass_objects_and_the_mesh():
    from picofx.passes import Overlap, Pipeline, Shard, TensorParallel

    with pytest.raises(CombinationError, match="Shard's compressed reduce-scatter beside tensor_parallel"):
        combinations.check_combination([Shard(compress="int8"), TensorParallel()])
    hsdp = ParallelMesh.build(dp_replicate=2, dp_shard=2, tp=2, world=8)
    with pytest.raises(CombinationError, match="the shard pass runs HSDP without tp"):
        combinations.check_combination([Shard(), TensorParallel()], hsdp)
    combinations.check_combination([Shard(), TensorParallel()], ParallelMesh.build(dp_shard=2, tp=2, world=4))
    combinations.check_combination([TensorParallel(sequence_parallel=True), Pipeline(stages=2), copy.copy(Overlap())])


def test_float8_is_read_from_the_precision_pass_and_implies_it():
    from picofx.passes import Precision, TensorParallel

    assert combinations.features_of([Precision(float8="tensorwise"), TensorParallel()]) == {
        "float8", "precision", "tensor_parallel"}
    assert combinations.features_of([Precision()]) == {"precision"}
    assert Cell(combinations.closed({"shard", "float8"})).describe() == "shard + float8"


def test_a_layout_for_more_ranks_is_described_under_a_one_rank_group():
    """A one-process tool (dump, the report) leaves a one-rank group; a layout for 8 ranks is still a
    description there, not a DeviceMesh over ranks that do not exist."""
    from picofx.parallel.mesh import one_process_group

    one_process_group()
    mesh = ParallelMesh.build(dp_replicate=2, dp_shard=2, tp=2, world=8)
    assert mesh.device_mesh is None and dict(mesh.sizes)["tp"] == 2


def test_joined_dimensions_are_one_dimension_over_the_ranks_of_both():
    """Shard's dp_shard x cp (torchtitan's dp_shard_cp): dimensions of size 1 drop out."""
    mesh = ParallelMesh.build(dp_replicate=2, dp_shard=2, cp=2, world=8)
    joined = mesh.joined("dp_shard", "cp")
    assert (joined.name, joined.size) == ("dp_shard_cp", 4)
    alone = ParallelMesh.build(dp_shard=1, cp=8, world=8).joined("dp_shard", "cp")
    assert (alone.name, alone.size) == ("cp", 8)


def test_the_docs_show_the_table():
    """docs/parallelism.md holds combinations.render_markdown() between its markers; regenerate with
    `python -c "from picofx.manager.combinations import write_into; write_into('docs/parallelism.md')"`."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "parallelism.md").read_text()
    begin, end = combinations.MARKERS
    assert begin in text and end in text, f"docs/parallelism.md has no {begin} ... {end} block"
    shown = text.split(begin, 1)[1].split(end, 1)[0]
    assert shown.strip() == combinations.render_markdown().strip(), (
        "docs/parallelism.md's table differs from the table: run python -c \"from picofx.manager.combinations "
        "import write_into; write_into('docs/parallelism.md')\"")


TRAINED_CELLS = (frozenset({"context_parallel", "tensor_parallel"}), frozenset({"context_parallel", "shard"}))


@pytest.mark.slow
def test_context_parallel_cells_train_three_adamw_steps_and_save_what_the_plain_model_loads(tmp_path):
    """cp x tp and cp x shard on 4 ranks: each step's loss equals one process's on the full batch, the
    parameters after three AdamW steps too (atol 1e-5: AdamW divides by the root of the second
    moment, so a gradient's last bits move the step's), and the ranks' DCP checkpoint loads into the
    plain model with those values."""
    import torch.distributed.checkpoint as dcp

    cells = [Cell(f) for f in TRAINED_CELLS]
    results = run_ranks(composability_ranks.adamw_and_checkpoint, 4, cells, str(tmp_path), timeout=600,
                        collective_timeout=120)
    z = tiny()
    optimizer = torch.optim.AdamW(z.model.parameters(), lr=1e-3)
    expected_losses = []
    for _ in range(3):
        inputs = {k: v for k, v in z.example_inputs.items() if k != "labels"}
        loss = z.loss_fn(z.model(**inputs), z.example_inputs["labels"])
        loss.backward()
        expected_losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    expected = {n: p.detach() for n, p in z.model.named_parameters()}
    for cell in cells:
        ranks = [r[cell] for r in results]
        assert all(r["tokens_per_rank"] == [tiny().example_inputs["input_ids"].shape[1] // 2] for r in ranks)
        for step, want in enumerate(expected_losses):
            by_replica = {r["replica"]: r["losses"][step] for r in ranks}
            assert len(by_replica) == ranks[0]["replicas"]
            torch.testing.assert_close(torch.stack(list(by_replica.values())).mean(), want, rtol=1e-5, atol=1e-6)
        for r in ranks:
            for name, value in expected.items():
                torch.testing.assert_close(r["parameters"][name], value, rtol=0, atol=1e-5, msg=name)
        plain = tiny().model
        state = plain.state_dict()
        dcp.load(state, checkpoint_id=str(tmp_path / cell_id(cell)), no_dist=True)
        plain.load_state_dict(state, strict=True)
        for name, value in expected.items():
            torch.testing.assert_close(plain.get_parameter(name), value, rtol=0, atol=1e-5, msg=name)
