import copy
import dataclasses

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import picofx
from picofx.cost.model import CostModel, optimizer_state_bytes
from picofx.cost import device as devices
from picofx.cost.device import DEVICES, H100, Device, calibrate, cpu
from picofx.models import zoo
from picofx.cost.liveness import Schedule, timeline
from picofx.cost.memory import measure_peak, peak_allocated_during, resident_bytes
from picofx.cost.units import parse_budget
from picofx.planner.predict import fake_mode, max_batch, predict, resize_inputs
from picofx.cost.symbolic import B, T
from picofx.planner.predict import fit_step

MiB = 2**20


def _loss(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def test_parse_budget():
    assert parse_budget(123) == 123
    assert parse_budget("8GiB") == 8 * 2**30
    assert parse_budget("512MiB") == 512 * MiB
    assert parse_budget("1.5GB") == 1_500_000_000
    assert parse_budget(" 2e9 ") == 2_000_000_000
    assert parse_budget(0.5, reference=1000) == 500
    for bad in ("8 parsecs", "GiB", -3):
        with pytest.raises(ValueError):
            parse_budget(bad)
    with pytest.raises(ValueError, match="fraction"):
        parse_budget(0.5)


def test_device_entries_and_calibration():
    assert DEVICES["h100"].flops_per_second(torch.bfloat16) == 989e12
    assert DEVICES["h200"].memory_bandwidth > DEVICES["h100"].memory_bandwidth > DEVICES["a100"].memory_bandwidth
    assert cpu(2).flops_per_second(torch.bfloat16) == cpu(2).flops_per_second(torch.float32)  # fp32 fallback
    measured = calibrate(cpu(), matmul_size=256, copy_bytes=8 * MiB, repeats=2)
    assert measured.source == "measured"
    assert 1e8 < measured.flops_per_second(torch.float32) < 1e14
    assert 1e8 < measured.memory_bandwidth < 1e13
    assert 0 < measured.op_overhead < 1e-3


def test_calibration_turns_times_into_rates(monkeypatch):
    """The rates calibrate derives from its timings: 2 n^3 FLOPs per matmul, a copy reads and
    writes its bytes, 100 adds per timed call (each timing here is 0.5 s)."""
    timed = []
    monkeypatch.setattr(devices, "_best_time", lambda fn, dev, repeats: timed.append(repeats) or 0.5)
    measured = calibrate(H100, dtypes=(torch.float32, torch.bfloat16), matmul_size=64, copy_bytes=MiB, repeats=3)
    assert timed == [3, 3, 3, 3]  # two matmuls, the copy, the adds
    assert measured.flops_per_second(torch.float32) == measured.flops_per_second(torch.bfloat16) == 2 * 64**3 / 0.5
    assert measured.flops_per_second(torch.float16) == H100.flops_per_second(torch.float16)  # not measured: kept
    assert measured.memory_bandwidth == 2 * MiB / 0.5 and measured.op_overhead == 0.5 / 100
    assert measured.memory_capacity == H100.memory_capacity and measured.name == f"{H100.name}, calibrated"


def test_measure_peak_counts_allocations_in_time_order():
    def step():
        a = torch.empty(1000, 1000)  # 4 MB
        b = torch.empty(1000, 1000)
        del a
        c = torch.empty(500, 1000)  # 2 MB, after a is gone
        return b, c

    assert peak_allocated_during(step) == 8_000_000
    resident = torch.empty(250, 1000)
    assert measure_peak(step, resident=[resident, resident.view(-1)]) == 9_000_000  # aliases counted once


def test_liveness_resolves_views_and_frees_after_last_use():
    def f(x):
        a = x * 2  # (64, 64) fp32: 16 KiB
        v = a.view(-1)  # no allocation
        b = v + 1  # a is still read below, so both are live here
        return (b.sum() + a.sum(),)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(64, 64))
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    from picofx.cost.liveness import storage_key
    line = timeline(gm, resident={storage_key(x.meta["val"])})
    allocated = {n.target.__name__ if hasattr(n.target, "__name__") else str(n.target): b
                 for n, b in zip(line.nodes, line.allocated_by.values())}
    assert allocated["view.default"] == 0
    assert line.peak == 2 * 16384 + 4  # a and b, plus the first scalar sum (b freed after its sum)
    kept = timeline(Schedule(line.nodes[:0], [], []), resident=set())
    assert kept.peak == 0


@pytest.mark.parametrize("name, holds_outputs", [("llama-tiny", False), ("hf-llama-tiny", False),
                                                  ("hf-llama-tiny", True)])
def test_predicted_step_peak_matches_measured(name, holds_outputs):
    z = zoo.build(name, batch=4, seq=64)
    opt = picofx.optimize(z.model, z.example_inputs, backend="eager", loss_fn=z.loss_fn)

    def step():
        z.model.zero_grad(set_to_none=True)
        out = opt(**z.example_inputs)  # Hugging Face's output holds the logits too
        if not holds_outputs:
            out = _loss(out)
        _loss(out).backward()

    step()
    z.model.zero_grad(set_to_none=True)
    measured = measure_peak(step, resident=(z.model, z.example_inputs))
    memory = CostModel("cpu", holds_outputs=holds_outputs).step_memory(opt.graphs["forward"], opt.graphs["backward"])
    assert memory.peak == pytest.approx(measured, rel=0.02)
    assert memory.parameters == memory.gradients == resident_bytes(list(z.model.parameters()))
    assert memory.saved_activations > memory.parameters  # activations dominate at this size
    assert memory.peak == memory.resident + max(memory.forward_peak, memory.backward_peak)
    # Tighter than 2%: the model is exact but for the contiguous copy the step makes of a sliced
    # input (the reference LLaMA's input_ids view a (4, 65) batch: 2 KiB, which the embedding's
    # backward saves) and a few bytes (the slice's storage beyond its view, a scalar). Measured:
    # 2088 B under on the reference LLaMA, 8 B on Hugging Face's; a missed (4, 64, 64) fp32
    # activation (64 KiB) fails here, where it would pass 2% of the 4.4-5.0 MiB peak.
    copies = sum(v.numel() * v.element_size() for v in z.example_inputs.values() if not v.is_contiguous())
    assert 0 <= measured - memory.peak <= copies + 64, (measured, memory.peak)
    assert saved_bytes(opt, z) == memory.saved_activations + copies  # what the forward saves for the backward


def saved_bytes(opt, z) -> int:
    """Bytes of the distinct storages the step's forward saves for its backward (autograd's
    saved-tensor hooks see each one), less the model's own tensors and the inputs."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        opt(**z.example_inputs)
    held = [*z.model.parameters(), *z.model.buffers(), *z.example_inputs.values()]
    resident = {t.untyped_storage().data_ptr() for t in held}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(n for ptr, n in storages.items() if ptr not in resident)


def test_node_time_is_compute_or_memory_bound():
    device = Device("test", {torch.float32: 1e12}, memory_bandwidth=1e11, memory_capacity=2**30,
                    link_bandwidth=1e10, link_latency=1e-6, network_bandwidth=1e9, network_latency=1e-5,
                    op_overhead=0.0)
    z = zoo.build("llama-tiny", batch=2, seq=32)
    gm = picofx.capture.capture(z.model, z.example_inputs, z.loss_fn)
    model = CostModel(device)
    by_target = {}
    for node in gm.graph.nodes:
        by_target.setdefault(str(node.target), node)
    linear, view, mul = by_target["aten.linear.default"], by_target["aten.view.default"], by_target["aten.mul.Tensor"]
    assert model.node_time(view) == 0.0
    assert model.node_time(linear) == pytest.approx(max(linear.meta["flops"] / 1e12, _moved(linear) / 1e11))
    assert model.node_time(mul) == pytest.approx(_moved(mul) / 1e11)  # elementwise: memory bound
    assert model.graph_time(gm) > 0 and model.graph_flops(gm) == sum(n.meta.get("flops", 0) for n in gm.graph.nodes)
    assert CostModel(dataclasses.replace(H100, op_overhead=0.0)).graph_time(gm) < model.graph_time(gm)
    overhead = dataclasses.replace(device, op_overhead=1e-5)
    assert CostModel(overhead).node_time(mul) == pytest.approx(model.node_time(mul) + 1e-5)


def _moved(node):
    inputs = sum(a.meta["val"].numel() * a.meta["val"].element_size() for a in dict.fromkeys(node.all_input_nodes))
    return inputs + node.meta["bytes"]


def test_optimizer_state_bytes():
    model = zoo.build("llama-tiny").model
    numel = sum(p.numel() for p in model.parameters())
    assert optimizer_state_bytes("adamw", model.parameters()) == 8 * numel
    assert optimizer_state_bytes(None, model.parameters()) == 0
    adam = torch.optim.AdamW(model.parameters())
    predicted = optimizer_state_bytes(adam, model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    adam.step()
    assert resident_bytes(adam) == predicted == optimizer_state_bytes(adam, model.parameters())
    with pytest.raises(ValueError, match="unknown optimizer"):
        optimizer_state_bytes("lion", model.parameters())


def test_symbolic_step_matches_direct_predictions():
    z = zoo.build("llama-tiny", batch=2, seq=16)
    step = fit_step(z.model, lambda b, t: resize_inputs(z.example_inputs, b, t), loss_fn=z.loss_fn,
                    optimizer="adamw")
    assert step.peak.free_symbols == {B, T} and step.flops.free_symbols == {B, T}
    for b, t in [(5, 40), (1, 128)]:
        direct = predict(z.model, resize_inputs(z.example_inputs, b, t), loss_fn=z.loss_fn, optimizer="adamw")
        assert int(step.peak.subs({B: b, T: t})) == step.peak_at(b, t) == direct.memory.peak
        assert int(step.flops.subs({B: b, T: t})) == direct.flops
        assert float(step.seconds.subs({B: b, T: t})) == pytest.approx(direct.seconds, rel=1e-9)
        assert int(step.saved_activations.subs({B: b, T: t})) == direct.memory.saved_activations
    budget = step.peak_at(6, 64)
    assert step.largest_batch(budget, seq=64) == 6


def test_max_batch_is_the_largest_batch_that_fits():
    z = zoo.build("llama-tiny", batch=2, seq=16)
    model = copy.deepcopy(z.model)
    budget = 8 * MiB
    best = max_batch(model, budget, 64, example_inputs=z.example_inputs, loss_fn=z.loss_fn)
    assert best >= 1

    def peak(b):
        return predict(model, resize_inputs(z.example_inputs, b, 64), loss_fn=z.loss_fn).memory.peak

    assert peak(best) <= budget < peak(best + 1)


def test_prediction_needs_no_real_weights():
    from picofx.models.llama import CONFIGS, Llama, causal_lm_loss

    real = zoo.build("llama-tiny", batch=2, seq=16)
    inputs = {k: v.contiguous() for k, v in real.example_inputs.items()}
    with fake_mode():
        model = Llama(CONFIGS["tiny"])
        fake_inputs = {k: torch.empty_like(v) for k, v in inputs.items()}
    assert predict(model, fake_inputs, loss_fn=causal_lm_loss).memory == \
        predict(real.model, inputs, loss_fn=real.loss_fn).memory
