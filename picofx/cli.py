"""`picofx dump MODEL`: show the graph picofx captured and what every pass did to it."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

from picofx.manager.dump import DumpGraphs, graph_dot, graph_text
from picofx.optimize import optimize


def load_model(spec: str):
    """A zoo name ("llama-tiny") or "path/to/file.py:factory"; the factory returns an object with
    `model`, `example_inputs` and `loss_fn` (or a tuple of the three)."""
    if ":" in spec:
        path, _, factory = spec.rpartition(":")
        if not os.path.exists(path):
            raise SystemExit(f"picofx dump: no file {path!r} (MODEL is a zoo name or path/to/file.py:factory)")
        module_spec = importlib.util.spec_from_file_location("picofx_user_model", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        if not hasattr(module, factory):
            raise SystemExit(f"picofx dump: {path} has no function {factory!r}")
        built = getattr(module, factory)()
    else:
        from picofx.examples import zoo

        if spec not in zoo.MODELS:
            raise SystemExit(f"picofx dump: unknown model {spec!r}; zoo models: {', '.join(sorted(zoo.MODELS))}, "
                             "or path/to/file.py:factory")
        built = zoo.build(spec)
    if isinstance(built, tuple):
        model, example_inputs, loss_fn = (*built, None)[:3]
        return model, example_inputs, loss_fn
    return built.model, built.example_inputs, built.loss_fn


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
    model, example_inputs, loss_fn = load_model(args.model)
    instruments = [DumpGraphs(args.output, formats=("txt",) if args.format == "text" else ("dot",))] \
        if args.output else []
    opt = optimize(model, example_inputs, passes=args.passes, backend=args.backend, loss_fn=loss_fn,
                   verify=args.verify, instruments=instruments)
    if args.format == "dot":
        print(graph_dot(opt.graph_module), end="")
        return
    print(graph_text(opt.graph_module))
    print(opt.report.table())
    print("\nnodes added and removed, pass by pass:")
    print(_changes(opt.report))
    if args.output:
        print(f"\nevery graph written to {args.output}/")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="picofx", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("dump", help="print the captured graph after the passes, and the pass table")
    p.add_argument("model", help="a zoo name (llama-tiny, hf-llama-tiny, gpt2-tiny, ...) or path/to/file.py:factory")
    p.add_argument("--passes", nargs="*", default=[], help="pass names, in order (e.g. fuse precision)")
    p.add_argument("--format", choices=["text", "dot"], default="text")
    p.add_argument("-o", "--output", help="also write every graph (NN_<pass>.txt or .dot) to this directory")
    p.add_argument("--backend", choices=["eager", "inductor"], default="eager")
    p.add_argument("--verify", choices=["invariants", "numerics"], default="invariants")
    args = parser.parse_args(argv)
    try:
        dump(args)
    except KeyError as e:  # unknown pass name: the message lists the available ones
        print(f"picofx dump: {e.args[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
