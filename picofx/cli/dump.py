"""`picofx dump MODEL`: show the graph picofx captured and what every pass did to it.

Exit status: 0 done; 1 the model or a pass failed (the message is printed, no traceback);
2 the command line is wrong (unknown model, pass or option).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import os
import re
import sys
import time

import torch

from picofx.capture.export import capture_call, input_key, split_inputs
from picofx.errors import CaptureError, InputShapeError, PassError, VerificationError
from picofx.manager import PASSES, PassManager, Stage, pass_info
from picofx.manager.passes import pass_stage
from picofx.manager.dump import DumpGraphs, graph_dot, graph_text
from picofx.manager.options import pass_options
from picofx.manager.report import Report
from picofx.api import captured_inputs, forward_context, graph_inputs, optimize
from picofx.parallel.layouts import recorded
from picofx.parallel.mesh import one_process_group
from picofx.capture.vocabulary import SIGNATURE_META

FORMATS = {"text": "one row per node (name, op, target, shape, dtype, FLOPs, bytes, module), the pass table, "
                   "and the nodes each pass added and removed",
           "dot": "the transformed forward graph as Graphviz dot"}


class UsageError(Exception):
    """The command line names something that does not exist or cannot be read (exit status 2)."""


def load_model(spec: str, shape: dict):
    """A zoo name ("llama-tiny") or "path/to/file.py:factory"; the factory returns an object with
    `model`, `example_inputs` and `loss_fn` (or a tuple of the three). `shape`: the batch and
    sequence length asked for (--batch, --seq), given to the zoo builder or the factory."""
    if ":" in spec:
        path, _, factory = spec.rpartition(":")
        if not os.path.exists(path):
            raise UsageError(f"no file {path!r} (MODEL is a zoo name or path/to/file.py:factory)")
        module_spec = importlib.util.spec_from_file_location("picofx_user_model", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        if not hasattr(module, factory):
            raise UsageError(f"{path} has no function {factory!r}")
        build = getattr(module, factory)
        parameters = inspect.signature(build).parameters
        missing = [name for name in shape if name not in parameters]
        if missing:
            raise UsageError(f"--{missing[0]}: {factory}() in {path} takes no {missing[0]!r} argument")
        built = build(**shape)
    else:
        from picofx.models import zoo

        if spec not in zoo.MODELS:
            raise UsageError(f"unknown model {spec!r}; zoo models: {', '.join(sorted(zoo.MODELS))}, "
                             "or path/to/file.py:factory")
        built = zoo.build(spec, **shape)
    if isinstance(built, tuple):
        model, example_inputs, loss_fn = (*built, None)[:3]
        return model, example_inputs, loss_fn
    return built.model, built.example_inputs, built.loss_fn


SHORT_FLAGS = {"budget": ("checkpoint", "budget"), "explain": ("fuse", "explain"), "dtype": ("precision", "dtype")}


def build_passes(args) -> list:
    """The pass objects the command line asks for, with the options given to their passes."""
    given: dict[str, dict] = {}
    flags: dict[str, str] = {}  # pass -> a flag that gave it an option, for messages
    for dest, value in vars(args).items():
        if dest.startswith("option:"):
            name, _, field = dest[len("option:"):].partition(".")
            given.setdefault(name, {})[field] = value
            flags.setdefault(name, f"--{name}.{field}")
    for flag, (name, field) in SHORT_FLAGS.items():
        if getattr(args, flag) not in (None, False):
            option = next(o for o in pass_options(name) if o.name == field)
            given.setdefault(name, {})[field] = option_value(option, str(getattr(args, flag)), f"--{flag}")
            flags.setdefault(name, f"--{flag}")
    for name in given:
        if name not in args.passes:
            raise UsageError(f"{flags[name]} is an option of the {name} pass: add {name} to --passes")
    passes = []
    for name in args.passes:
        if name not in PASSES:
            raise UsageError(f"unknown pass {name!r}; available passes: {', '.join(sorted(PASSES))}")
        factory = PASSES[name]
        try:
            passes.append(factory(**given.get(name, {})) if isinstance(factory, type) else factory())
        except (TypeError, ValueError) as e:
            raise UsageError(f"{name}: {e}") from None
    return passes


def option_value(option, text: str, flag: str):
    """A short flag's value (--budget 0.8) as its pass option takes it."""
    try:
        return option.parse(text)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None


def _changes(report) -> str:
    lines = []
    for record in report.records:
        if not (record.added or record.removed):
            continue
        lines.append(f"{record.name} ({record.stage.value}, {record.graph_role}): "
                     f"+{len(record.added)} -{len(record.removed)}")
        lines += [f"  - {r}" for r in record.removed] + [f"  + {a}" for a in record.added]
    return "\n".join(lines) or "(no pass changed a node)"


def dump(args) -> None:
    passes = build_passes(args)  # usage mistakes first: before the model is built
    shape = {name: getattr(args, name) for name in ("batch", "seq") if getattr(args, name) is not None}
    model, example_inputs, loss_fn = load_model(args.model, shape)
    if any(pass_info(p).communicates for p in passes):  # overlap: show its graphs on a one-rank group
        one_process_group()
    instruments = [DumpGraphs(args.output, formats=("txt",) if args.format == "text" else ("dot",))] \
        if args.output else []
    if any(pass_info(p).splits_graph for p in passes):  # pipeline: plan the stages, run no rank
        graphs, report = plan_stages(model, example_inputs, passes, loss_fn, args, instruments)
    else:
        opt = optimize(model, example_inputs, passes=passes, backend=args.backend, loss_fn=loss_fn,
                       verify=args.verify, instruments=instruments)
        graphs, report = [opt.graph_module], opt.report
    if args.html:  # the partitioned graphs where compiled, else the pipeline's stage graphs
        report.to_html(args.html, **({} if report.graphs else {"graphs": graphs}), title=f"picofx dump {args.model}",
                       subtitle=f"passes: {' '.join(args.passes) or '(none)'}")
    if args.format == "dot":
        print("".join(graph_dot(gm) for gm in graphs), end="")
        return
    for gm in graphs:
        if len(graphs) > 1:
            stage = recorded(gm).stage
            print(f"stage {stage.index} of {stage.num_stages}:")
        print(graph_text(gm) + ("\n" if len(graphs) > 1 else ""))
    print(report.table(wide=args.wide))
    print("\nnodes added and removed, pass by pass:")
    print(_changes(report))
    if args.output:
        print(f"\nevery graph written to {args.output}/")
    if args.html:
        print(f"\nthe report as a page: {args.html}")


def plan_stages(model, example_inputs, passes, loss_fn, args, instruments) -> tuple[list, Report]:
    """The stage graphs a splitting pass (pipeline) makes from one micro-batch's captured step, and
    the report of the forward passes, on this process: no rank runs and nothing is compiled. The
    joint and partitioned passes run on each stage's rank under torchrun."""
    manager = PassManager(passes, verify=args.verify, instruments=instruments)
    try:
        call_args, kwargs = captured_inputs(manager, *split_inputs(example_inputs))
    except ValueError as e:
        raise UsageError(f"{e} On this command line: --batch, and the pass's options.") from None
    start = time.perf_counter()
    gm = capture_call(model, call_args, kwargs, loss_fn)
    report = Report(backend="not run", input_key=input_key(call_args, kwargs),
                    capture_seconds=time.perf_counter() - start, records=manager.records)
    signature = gm.meta[SIGNATURE_META]
    inputs = graph_inputs(signature, model, call_args, kwargs)
    ctx = forward_context(model, signature, inputs, backend=args.backend, options={})
    manager.announce("captured", gm, ctx)
    graphs = manager.run(Stage.FORWARD, gm, ctx)
    layout = recorded(graphs[0]).pipeline
    if layout is not None:
        report.sections["pipeline"] = layout.table()
    later = [p for p in manager.passes if pass_stage(p) is not Stage.FORWARD]
    if later:
        report.sections["not shown"] = (f"{', '.join(type(p).__name__ for p in later)} run on each stage's "
                                        "graph on its rank under torchrun; this shows the forward stage graphs")
    return graphs, report


def option_type(option):
    """argparse's converter for a pass option: a wrong value is a usage error (exit status 2)."""
    def convert(text: str):
        try:
            return option.parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


def given_options(name: str) -> list:
    """The options of the registered pass `name` a caller gives: not the fields the pass keeps for
    itself (init=False, such as the state it holds per model)."""
    factory = PASSES[name]
    own = {f.name for f in dataclasses.fields(factory) if not f.init} if dataclasses.is_dataclass(factory) else set()
    return [o for o in pass_options(name) if o.name not in own]


def add_pass_options(p: argparse.ArgumentParser) -> None:
    """One flag per option of every registered pass, from its dataclass fields: --pipeline.microbatches 8."""
    for name in sorted(PASSES):
        options = given_options(name)
        stage = pass_stage(PASSES[name]())  # the pass with its default options declares it
        python_only = [o.name for o in options if not o.from_text]
        described = "no options" if not options else \
            f"options only Python can give: {', '.join(python_only)}" if python_only else None
        group = p.add_argument_group(f"{name} ({stage.value} stage)", described)
        for option in options:
            if option.from_text:
                group.add_argument(f"--{name}.{option.name}", dest=f"option:{name}.{option.name}",
                                   default=argparse.SUPPRESS, type=option_type(option),
                                   metavar=option.type.replace(" ", ""),
                                   **({"nargs": "?", "const": True} if option.kinds == ("bool",) else {}),
                                   help=f"{option.describe()} (default: {option.default!r})")


def pass_summary() -> str:
    """One line per registered pass: its stage and its options with their defaults."""
    lines = []
    for name in sorted(PASSES):
        stage = pass_stage(PASSES[name]())  # the pass with its default options declares it
        shown = ", ".join(f"{o.name}={o.default!r}" for o in given_options(name))
        lines.append(f"  {name:<12} {stage.value} stage; options: {shown or 'none'}")
    return "\n".join(lines)


def add_dump_parser(commands) -> None:
    formats = "\n".join(f"  {name:<12} {text}" for name, text in FORMATS.items())
    p = commands.add_parser(
        "dump", help="print the captured graph after the passes, and the pass table",
        description="Capture MODEL's training step, run --passes over it, and print the graph and what each "
                    "pass did.\nExit status: 0 done, 1 the model or a pass failed, 2 a wrong command line.\n"
                    "Every option of every pass is a flag --PASS.OPTION (listed below, per pass).",
        epilog=f"passes (in Python: picofx.passes.Checkpoint(budget=...)):\n{pass_summary()}\n\n"
               f"formats:\n{formats}\n\nexamples:\n  picofx dump llama-tiny --passes fuse checkpoint --budget 0.8\n"
               "  picofx dump llama-tiny --passes pipeline --batch 4 --pipeline.stages 2 --pipeline.microbatches 2\n"
               "  picofx dump hf-llama-tiny --format dot > graph.dot",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a zoo name (llama-tiny, hf-llama-tiny, gpt2-tiny, ...) or path/to/file.py:factory")
    p.add_argument("--passes", nargs="*", default=[], metavar="PASS",
                   help=f"pass names, run each at its stage: {', '.join(sorted(PASSES))} (default: none)")
    p.add_argument("--batch", type=positive, help="the example batch's size (default: the model's, 2 in the zoo)")
    p.add_argument("--seq", type=positive, help="the example batch's sequence length (default: the model's, 32 "
                                                "in the zoo)")
    p.add_argument("--budget", help="short for --checkpoint.budget: 8GiB, 512MiB, 1.5GB, bytes, or a fraction "
                                    "of the predicted peak such as 0.8 (default: the device's memory)")
    p.add_argument("--explain", action="store_true", help="short for --fuse.explain: also list the candidates "
                                                          "no rule took, and why")
    p.add_argument("--dtype", choices=["bf16", "fp16"], help="short for --precision.dtype (default: bf16)")
    p.add_argument("--format", choices=list(FORMATS), default="text", help="what to print (default: text)")
    p.add_argument("-o", "--output", help="also write every graph (NN_<pass>.txt or .dot) to this directory")
    p.add_argument("--backend", choices=["eager", "inductor"], default="eager",
                   help="run the graphs as they are, or generate code with Inductor (default: eager)")
    p.add_argument("--verify", choices=["invariants", "numerics"], default="invariants",
                   help="after each pass check the graph's invariants, or also its numbers (default: invariants)")
    p.add_argument("--wide", action="store_true", help="the pass table with every note on one line")
    p.add_argument("--html", metavar="FILE", help="also write the report as one self-contained HTML page: the passes, "
                                                  "predicted memory and timeline, the pipeline schedule")
    add_pass_options(p)


def positive(text: str) -> int:
    if not re.fullmatch(r"[0-9]+", text.strip()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, not {text!r}")
    return int(text)


def run_dump(args) -> int:
    """`picofx dump`: 0 done; 1 the model or a pass failed; 2 a wrong command line."""
    try:
        dump(args)
    except UsageError as e:
        print(f"picofx dump: {e}", file=sys.stderr)
        return 2
    except (CaptureError, PassError, VerificationError, InputShapeError) as e:
        print(f"picofx dump: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # the user's model or factory raised: say what, without the traceback
        print(f"picofx dump: the model failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0
