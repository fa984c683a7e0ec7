"""The `picofx` command: `train` the reference LLaMA, `plan` a run's layout, `dump` what the passes did,
`export` a checkpoint as a Hugging Face model, `doctor` a run's records: what to change.

Exit status: 0 done; 1 the model, a pass or the run failed (the message is printed, no traceback);
2 the command line is wrong (unknown model, pass or option).
"""
from __future__ import annotations

import argparse
import sys

import torch

import picofx
from picofx.cli.doctor import add_doctor_parser, run_doctor
from picofx.cli.dump import add_dump_parser, run_dump
from picofx.cli.export import add_export_parser, run_export
from picofx.cli.plan import add_plan_parser, plan_command


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="picofx", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--version", action="version",
                     version=f"picofx {picofx.__version__} (torch {torch.__version__})")
    commands = top.add_subparsers(dest="command", required=True)
    commands.add_parser("train", add_help=False, help="train the reference LLaMA (picofx train --help)")
    add_plan_parser(commands)
    add_dump_parser(commands)
    add_export_parser(commands)
    add_doctor_parser(commands)
    return top


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # its own parser: `picofx train --help` lists every training option
        from picofx.cli.train import main as train

        train(argv[1:])
        return 0
    args = parser().parse_args(argv)  # a wrong option exits with status 2 here
    if args.command == "plan":
        try:
            plan_command(args)
        except ValueError as e:
            print(f"picofx plan: {str(e).removeprefix('picofx plan: ')}", file=sys.stderr)  # said once
            return 2
        return 0
    if args.command == "export":
        return run_export(args)
    if args.command == "doctor":
        return run_doctor(args)
    return run_dump(args)
