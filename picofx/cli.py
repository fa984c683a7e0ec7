"""`picofx dump MODEL`: show the graph picofx captured and what every pass did to it.

Exit status: 0 done; 1 the model or a pass failed (the message is printed, no traceback);
2 the command line is wrong (unknown model, pass or option).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import os
import re
import sys

from picofx.errors import CaptureError, InputShapeError, PassError, VerificationError
from picofx.manager import PASSES
from picofx.manager.dump import DumpGraphs, graph_dot, graph_text
from picofx.optimize import optimize
from picofx.runtime.distributed import single_process_group

FORMATS = {"text": "one row per node (name, op, target, shape, dtype, FLOPs, bytes, module), the pass table, "
                   "and the nodes each pass added and removed",
           "dot": "the transformed forward graph as Graphviz dot"}


class UsageError(Exception):
    """The command line names something that does not exist or cannot be read (exit status 2)."""


def load_model(spec: str):
    """A zoo name ("llama-tiny") or "path/to/file.py:factory"; the factory returns an object with
    `model`, `example_inputs` and `loss_fn` (or a tuple of the three)."""
    if ":" in spec:
        path, _, factory = spec.rpartition(":")
        if not os.path.exists(path):
            raise UsageError(f"no file {path!r} (MODEL is a zoo name or path/to/file.py:factory)")
        module_spec = importlib.util.spec_from_file_location("picofx_user_model", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        if not hasattr(module, factory):
            raise UsageError(f"{path} has no function {factory!r}")
        built = getattr(module, factory)()
    else:
        from picofx.examples import zoo

        if spec not in zoo.MODELS:
            raise UsageError(f"unknown model {spec!r}; zoo models: {', '.join(sorted(zoo.MODELS))}, "
                             "or path/to/file.py:factory")
        built = zoo.build(spec)
    if isinstance(built, tuple):
        model, example_inputs, loss_fn = (*built, None)[:3]
        return model, example_inputs, loss_fn
    return built.model, built.example_inputs, built.loss_fn


def budget_value(text: str):
    """--budget as the pass takes it: '8GiB' stays a string, '0.8' is a fraction, '1000000' bytes."""
    if re.fullmatch(r"\s*[0-9]+\s*", text):
        return int(text)
    if re.fullmatch(r"\s*[0-9]*\.[0-9]+\s*", text):
        return float(text)
    return text


def build_passes(args) -> list:
    """The pass objects the command line asks for, with the options given to their passes."""
    options = {"checkpoint": {"budget": budget_value(args.budget)} if args.budget else {},
               "fuse": {"explain": True} if args.explain else {},
               "precision": {"dtype": args.dtype} if args.dtype else {}}
    for name, given in options.items():
        if given and name not in args.passes:
            flag = {"checkpoint": "--budget", "fuse": "--explain", "precision": "--dtype"}[name]
            raise UsageError(f"{flag} is an option of the {name} pass: add {name} to --passes")
    passes = []
    for name in args.passes:
        if name not in PASSES:
            raise UsageError(f"unknown pass {name!r}; available passes: {', '.join(sorted(PASSES))}")
        factory = PASSES[name]
        try:
            passes.append(factory(**options.get(name, {})) if isinstance(factory, type) else factory())
        except (TypeError, ValueError) as e:
            raise UsageError(f"{name}: {e}") from None
    return passes


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
    model, example_inputs, loss_fn = load_model(args.model)
    if any(getattr(p, "communicates", False) for p in passes):  # overlap: show its graphs on a one-rank group
        single_process_group()
    instruments = [DumpGraphs(args.output, formats=("txt",) if args.format == "text" else ("dot",))] \
        if args.output else []
    opt = optimize(model, example_inputs, passes=passes, backend=args.backend, loss_fn=loss_fn,
                   verify=args.verify, instruments=instruments)
    if args.format == "dot":
        print(graph_dot(opt.graph_module), end="")
        return
    print(graph_text(opt.graph_module))
    print(opt.report.table(wide=args.wide))
    print("\nnodes added and removed, pass by pass:")
    print(_changes(opt.report))
    if args.output:
        print(f"\nevery graph written to {args.output}/")


def pass_options() -> str:
    """Each registered pass and its options with their defaults, for --help."""
    lines = []
    for name in sorted(PASSES):
        factory = PASSES[name]
        fields = dataclasses.fields(factory) if dataclasses.is_dataclass(factory) else ()
        shown = ", ".join(f"{f.name}={f.default!r}" if f.default is not dataclasses.MISSING else
                          f"{f.name}={f.default_factory()!r}" if f.default_factory is not dataclasses.MISSING
                          else f.name for f in fields)
        stage = getattr(factory, "stage", None)
        lines.append(f"  {name:<12} {getattr(stage, 'value', 'forward')} stage; options: {shown or 'none'}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="picofx", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = top.add_subparsers(dest="command", required=True)
    formats = "\n".join(f"  {name:<12} {text}" for name, text in FORMATS.items())
    p = commands.add_parser(
        "dump", help="print the captured graph after the passes, and the pass table",
        description="Capture MODEL's training step, run --passes over it, and print the graph and what each "
                    "pass did.\nExit status: 0 done, 1 the model or a pass failed, 2 a wrong command line.",
        epilog=f"passes (options in Python: picofx.passes.Checkpoint(budget=...)):\n{pass_options()}\n\n"
               f"formats:\n{formats}\n\nexamples:\n  picofx dump llama-tiny --passes fuse checkpoint --budget 0.8\n"
               "  picofx dump hf-llama-tiny --format dot > graph.dot",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a zoo name (llama-tiny, hf-llama-tiny, gpt2-tiny, ...) or path/to/file.py:factory")
    p.add_argument("--passes", nargs="*", default=[], metavar="PASS",
                   help=f"pass names, run each at its stage: {', '.join(sorted(PASSES))} (default: none)")
    p.add_argument("--budget", help="checkpoint's memory budget: 8GiB, 512MiB, 1.5GB, bytes, or a fraction "
                                    "of the predicted peak such as 0.8 (default: the device's memory)")
    p.add_argument("--explain", action="store_true", help="fuse: also list the candidates no rule took, and why")
    p.add_argument("--dtype", choices=["bf16", "fp16"], help="precision: the low-precision dtype (default: bf16)")
    p.add_argument("--format", choices=list(FORMATS), default="text", help="what to print (default: text)")
    p.add_argument("-o", "--output", help="also write every graph (NN_<pass>.txt or .dot) to this directory")
    p.add_argument("--backend", choices=["eager", "inductor"], default="eager",
                   help="run the graphs as they are, or generate code with Inductor (default: eager)")
    p.add_argument("--verify", choices=["invariants", "numerics"], default="invariants",
                   help="after each pass check the graph's invariants, or also its numbers (default: invariants)")
    p.add_argument("--wide", action="store_true", help="the pass table with every note on one line")
    return top


def main(argv=None) -> int:
    args = parser().parse_args(argv)  # a wrong option exits with status 2 here
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


if __name__ == "__main__":
    sys.exit(main())
