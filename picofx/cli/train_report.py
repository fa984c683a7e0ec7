"""picofx train --report: the run's HTML page, written at the end of the run and when SIGTERM or
Ctrl-C stops it, titled by the model trained, its loss curve covering every step since the run
began (a resumed run reads the earlier steps' losses from its checkpoint)."""
from __future__ import annotations


def model_name(args) -> str:
    """The model the run trained: a Hugging Face model's name or folder, or the reference LLaMA's size."""
    return args.model or f"reference LLaMA {args.size}"


def write_report(args, ranks, session, saves, layout: str, *, stopped: str = "", measured: dict | None = None) -> None:
    """Rank 0 writes --report (where given); `stopped`: why and where the run stopped early; `measured`:
    --profile's to_html arguments (each rank's measured step)."""
    if not args.report or not ranks.speaks:
        return
    losses, first = saves.history(), saves.first_step
    steps = f"steps {first}-{first + len(losses) - 1}" if first > 1 else f"{len(losses)} steps"
    resumed = f", resumed at step {session.start_step}" if session.start_step else ""
    passes = " ".join(session.passes) or "(none)"
    subtitle = (f"{layout}; {steps} of {args.batch} x {args.seq} tokens on {args.device}{resumed}, passes {passes}"
                + (f"; {stopped}" if stopped else ""))
    session.opt_model.report.to_html(args.report, losses=losses, first_step=first,
                                     title=f"picofx train: {model_name(args)}", subtitle=subtitle,
                                     **(measured or {}))
    ranks.say(f"wrote {args.report}")
