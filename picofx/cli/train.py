"""Train the reference LLaMA with picofx on a corpus already on the machine.

The corpus is the Python standard library's own source (no download), read as bytes: the
tokenizer is byte-level (256 tokens). Shows a progress bar and per-interval loss and tokens/s,
then a summary (the first and last step's loss, tokens/s over the run, MFU) and picofx's report.
--data trains on a text file instead, --save/--resume continue a run exactly where it stopped.

One process:

    picofx train                                             # CPU, fuse + Inductor, 200 steps
    picofx train --backend eager --steps 50 --passes         # no passes, no code generation
    picofx train --passes checkpoint --memory-budget 0.7     # 70% of the step's peak without it
    picofx train --data notes.txt --steps 100 --save run1    # your text, saved at the end
    picofx train --data notes.txt --steps 200 --resume run1  # and on to step 200

Under torchrun, one process per rank (without --dp or --pp every rank is a data-parallel replica):

    torchrun --nproc-per-node 2 -m picofx train --dp 2                     # 2 replicas, pass overlap
    torchrun --nproc-per-node 2 -m picofx train --dp 2 --compress int8:ef  # gradients sent as int8
    torchrun --nproc-per-node 2 -m picofx train --shard --compress int8    # reduce-scattered as int8
    torchrun --nproc-per-node 2 -m picofx train --pp 2                     # 2 pipeline stages
    torchrun --nproc-per-node 4 -m picofx train --dp 2 --pp 2              # 2 stages x 2 replicas
    torchrun --nproc-per-node 4 -m picofx train --tp 2 --shard             # 1/4 of the model per rank
    torchrun --nproc-per-node 4 -m picofx train --tp 2 --pp 2              # 2 stages, each 2-way tp
    torchrun --nproc-per-node 8 -m picofx train --tp 2 --pp 2 --shard      # each stage's pieces sharded
    torchrun --nproc-per-node 4 -m picofx train --layout auto              # the layout predicted fastest

On a CPU each rank runs OMP_NUM_THREADS threads (torchrun sets 1 where it is not set): keep ranks x
threads within the machine's cores, or every step slows; the run warns when they exceed them.
"""
from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time
import typing

import torch
from tqdm import tqdm

import picofx
from picofx.cli import train_model, train_profile, train_state
from picofx.models.llama import causal_lm_loss
from picofx.cli.train_args import parse_args, run_options
from picofx.cli.train_layout import (choose_layout, layout_line, replica_batch, replica_of, run_layout, train_mesh,
                                     train_recipe)
from picofx.cli.train_data import Batches, DataError
from picofx.cli.train_guards import NonFinite, clip_gradients, gradient_norm, group_timeout, step_collectives
from picofx.cli.train_report import write_report
from picofx.cli.train_metrics import StepMetrics, oversubscribed, throughput
from picofx.diagnose import StepLog, diagnose, what_to_change
from picofx.manager import pass_name
from picofx.errors import DistributedError
from picofx.parallel.launch import join_launched_group, rendezvous_store
from picofx.runtime.checkpoints import SecondInterrupt, probe_writable
from picofx.runtime.distributed import first_failure
from picofx.runtime.watchdog import Watchdog

# Errors that are the user's to fix, and say how: one line, no traceback. Anything else is a bug,
# and keeps its traceback.
STOPS = (picofx.CaptureError, picofx.PassError, picofx.VerificationError, picofx.InputShapeError,
         picofx.BudgetError, DistributedError, DataError)
INTERRUPTED = 130  # the exit status of a run stopped by Ctrl-C (128 + SIGINT), saved or not
AGREEMENT_SECONDS = 180  # how long a rank whose setup failed waits for the others to say how theirs ended


class Ranks:
    """This process's place in the run: one process, or a rank of torchrun's process group with a
    second group of its own (its own timeout) on which ranks agree whether their setup succeeded."""

    def __init__(self, args, layout=None):
        self.world, self.rank, self.agreement, self.owns_group = args.world, 0, None, False
        self.layout = layout or run_layout(args)  # the run's one description (picofx.planner.layouts.Layout)
        self.watchdog = None  # under torchrun: stops every rank when one stops answering
        if args.world > 1:  # torchrun's rendezvous; a caller may have made the group already
            self.rank, self.agreement, self.owns_group = join_launched_group(
                args.device, group_timeout(args.collective_timeout), datetime.timedelta(seconds=AGREEMENT_SECONDS))
            self.watchdog = Watchdog(rendezvous_store(), self.rank, self.world, args.collective_timeout).start()
        self.replica = replica_of(self.rank, self.layout)
        self.speaks = self.rank == 0

    def say(self, *args, **kwargs) -> None:
        if self.speaks:
            print(*args, **kwargs, flush=True)

    def stop_if_failed(self, message: str | None) -> None:
        """Every rank stops (exit status 1) when any rank's setup failed; the error is printed once."""
        if self.world == 1:
            if message is not None:
                print(f"picofx train: error: {message}", file=sys.stderr, flush=True)
                sys.exit(1)
            return
        try:
            failure = first_failure(message, self.agreement)
        except RuntimeError:  # the others never came (stuck in a collective this rank left): say it here
            failure = (self.rank, message) if message is not None else None
            self.speaks = message is not None
        if failure is None:
            return
        rank, text = failure
        where = f" (rank {rank})" if rank != 0 else ""
        self.say(f"picofx train: error{where}: {text}", file=sys.stderr)
        self.close()
        os._exit(1)  # a rank with a process group can hang at interpreter exit

    def total(self, value: float) -> float:
        """`value` summed over every rank."""
        import torch.distributed as dist

        tensor = torch.tensor(value, dtype=torch.float64)
        dist.all_reduce(tensor)
        return tensor.item()

    def at(self, step: int, phase: str) -> None:
        if self.watchdog is not None:
            self.watchdog.at(step, phase)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.owns_group:
            torch.distributed.destroy_process_group()


class Session(typing.NamedTuple):
    model: torch.nn.Module
    opt_model: object
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LambdaLR
    batches: Batches
    first: dict     # the batch the step was captured with: step 0's
    passes: list    # the names of the passes picofx ran, the layout's included
    start_step: int
    loss_fn: typing.Callable = causal_lm_loss  # the model's output and the labels -> the loss


def setup(args, ranks: Ranks) -> Session:
    """The model, its data, the optimized step and the optimizer, resumed where --resume says."""
    passes, mesh = train_recipe(args, ranks.layout).passes, train_mesh(args, ranks.layout)
    model, loss_fn, tokens, data_line = train_model.build(args)  # --size's reference LLaMA, or --model's
    if data_line:
        ranks.say(data_line)
    batches = Batches(tokens, args.batch, args.seq, args.seed + ranks.replica)
    first = {k: v.to(args.device) for k, v in batches.sample().items()}
    opt_model = picofx.optimize(model, first, passes=passes, backend=args.backend, mesh=mesh,
                                loss_fn=loss_fn, dump_dir=args.dump_dir,
                                progress=ranks.say if ranks.speaks else None)
    optimizer = torch.optim.AdamW(opt_model.parameters(), lr=args.lr, weight_decay=0.01)  # pipelined: this stage's
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    start_step = 0
    if args.resume:  # after the first batch was drawn for capture: the sampler continues from the saved position
        start_step = train_state.resume(args.resume, opt_model, optimizer, schedule, batches, replica=ranks.replica)
    batches.prefetch(args.device, args.data_workers)  # the next batches, prepared while the steps run
    return Session(model, opt_model, optimizer, schedule, batches, first, [pass_name(p) for p in passes], start_step,
                   loss_fn)


def auto_layout(args, ranks: Ranks) -> None:
    """--layout auto: every rank takes rank 0's plan (printed with why; rank 0 chose among runnable ones)."""
    message = why = None
    try:
        ranks.layout, why = choose_layout(args, ranks.rank)
    except ValueError as e:
        message = str(e)
    ranks.stop_if_failed(message)
    ranks.replica = replica_of(ranks.rank, ranks.layout)
    ranks.say(why)


def threads_note(args) -> str:
    if torch.device(args.device).type != "cpu":
        return ""
    threads = torch.get_num_threads()
    return f" ({threads} thread{'s' if threads > 1 else ''}{' per rank' if args.world > 1 else ''})"


def main(argv=None) -> dict:
    """The run; Ctrl-C where no checkpoint is due (or a second one) ends it in one line, status 130."""
    args = parse_args(argv, __doc__)
    try:
        return run(args)
    except KeyboardInterrupt as e:
        if isinstance(e, SecondInterrupt):
            line = "stopped by a second Ctrl-C, the step in progress not saved"
        elif args.save:
            line = "stopped by Ctrl-C before the steps began or after the last one was saved"
        else:
            line = "stopped by Ctrl-C, nothing saved (pass --save DIR to checkpoint at the step boundary)"
        if os.environ.get("RANK", "0") == "0":
            print(f"\npicofx train: {line}", file=sys.stderr, flush=True)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            os._exit(INTERRUPTED)  # a rank with a process group can hang at interpreter exit
        sys.exit(INTERRUPTED)


def run(args) -> dict:
    if args.complete is not None:  # --resume auto on a run that already reached --steps: nothing to do
        if os.environ.get("RANK", "0") == "0":
            print(f"picofx train: {args.complete}", flush=True)
        return {"losses": [], "complete": True}
    ranks = Ranks(train_profile.armed(args))  # --profile on CUDA: OOM snapshot, flight recorder, before the group
    ranks.stop_if_failed(train_state.resume_disagreement(args.resume, ranks.agreement))
    if args.save:  # every rank, before any capture or step: an unwritable --save would lose the run
        ranks.stop_if_failed(probe_writable(args.save, ranks.rank))
    if args.layout == "auto" and args.world > 1 and args.resumed_layout is None:
        auto_layout(args, ranks)
    elif args.layout_chosen:
        ranks.say(args.layout_chosen)
    # from here --batch is one replica's (--layout auto's global batch split), as a checkpoint records it
    args = argparse.Namespace(**{**vars(args), "batch": replica_batch(args, ranks.layout), "layout": None})
    ranks.say(f"picofx train: {layout_line(ranks.layout, args.world, args.dp_default)}; {args.model or args.size} "
              f"model, {args.steps} steps of {args.batch} x {args.seq} tokens on {args.device}{threads_note(args)}, backend {args.backend}")
    if torch.device(args.device).type == "cpu":
        warning = oversubscribed(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.get_num_threads())
        if warning:
            ranks.say(f"picofx train: warning: {warning}", file=sys.stderr)
    message = None
    try:
        session = setup(args, ranks)
    except STOPS as e:
        message = str(e)
    ranks.stop_if_failed(message)
    try:
        return train_steps(args, ranks, session)
    except Exception as e:  # a collective failed because a rank died (its heartbeat stopped): one line, status 1
        if ranks.watchdog is not None:
            ranks.watchdog.stop_if_a_peer_died(e, before_stop=session.batches.stop)
        raise
    finally:
        session.batches.stop()  # the DataLoader workers end here, whether the run returned or raised


def train_steps(args, ranks: Ranks, s: Session) -> dict:
    """The steps, the saves and the summary of a set-up run."""
    resumed = f"; resumed from {args.resume} at step {s.start_step}" if args.resume else ""
    ranks.say(f"picofx: {sum(p.numel() for p in s.model.parameters()) / 1e6:.2f}M parameters, "
              f"passes: {' '.join(s.passes) or '(none)'}{resumed}")

    layout = ranks.layout
    collectives = step_collectives(layout)
    nonfinite = NonFinite(skip=args.skip_nonfinite, world=args.world, order=[n for n, _ in s.model.named_parameters()],
                          speaks=ranks.speaks, close=ranks.close)
    metrics = StepMetrics.of_run(args, layout, s.model, s.opt_model, speaks=ranks.speaks, append=s.start_step > 0,
                                 total=ranks.total)
    saves = train_state.PeriodicSaves(args, s, group=ranks.agreement, rank=ranks.rank, replica=ranks.replica,
                                      options=run_options(args, layout))  # before the loop: SIGTERM from here on saves
    profiling = train_profile.RunProfile(args, s, saves)  # --profile N: its phases wrap s's and saves' methods
    history, losses, interval = [], saves.losses, {"loss": 0.0, "tokens": 0, "steps": 0, "start": time.perf_counter()}
    run_start, run_tokens = interval["start"], 0
    steps_log = StepLog(run={"batch": args.batch, "data_workers": args.data_workers, "device": args.device})
    progress = tqdm(range(s.start_step, args.steps), desc="train", unit="step", disable=not ranks.speaks)
    for step in progress:
        started, cpu_started = time.perf_counter(), time.process_time()
        ranks.at(step + 1, f"forward and backward ({collectives})")
        batch = s.first if step == 0 else s.batches.next()
        data_s = time.perf_counter() - started
        loss = s.opt_model.forward_backward(**batch)
        replicas = layout.dp_replicate if layout.pp > 1 else None
        ranks.at(step + 1, "gradient norm and non-finite check (all-reduces)")
        norm, lr = gradient_norm(list(s.opt_model.parameters()), replicas), s.schedule.get_last_lr()[0]
        if nonfinite.finite(step + 1, loss, norm, s.opt_model.named_parameters()):  # else stops, or skips the step
            clip_gradients(list(s.opt_model.parameters()), 1.0, norm, pipelined=replicas is not None)
            ranks.at(step + 1, "optimizer step")
            s.optimizer.step()
        s.schedule.step()
        s.optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        interval["loss"] += losses[-1]
        interval["tokens"] += batch["input_ids"].numel()
        interval["steps"] += 1
        run_tokens += batch["input_ids"].numel()
        record = {"step": step + 1, "loss": losses[-1], "lr": lr, "grad_norm": nonfinite.norm,  # for picofx.diagnose
                  "step_s": time.perf_counter() - started, "data_s": data_s, "cpu_s": time.process_time() - cpu_started}
        if metrics is not None:
            record = metrics.write(step + 1, loss=losses[-1], lr=lr, grad_norm=nonfinite.norm,
                                   tokens=batch["input_ids"].numel(), seconds=record["step_s"], data_s=data_s,
                                   cpu_s=record["cpu_s"])
        steps_log.add(record)
        ranks.at(step + 1, "end (logging, checkpointing)")
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            seconds = time.perf_counter() - interval["start"]
            entry = {"step": step + 1, "loss": interval["loss"] / interval["steps"],
                     "tokens_per_s": interval["tokens"] / seconds}
            history.append(entry)
            if ranks.speaks:
                progress.write(f"step {entry['step']:5d}  loss {entry['loss']:.4f}  {entry['tokens_per_s']:,.0f} tokens/s")
            progress.set_postfix(loss=f"{entry['loss']:.3f}", tokens_per_s=f"{entry['tokens_per_s']:,.0f}")
            interval = {"loss": 0.0, "tokens": 0, "steps": 0, "start": time.perf_counter()}
        if profiling.end_step(step + 1, saves.after_step):  # saved before the validation batch is drawn (as resumed)
            break
    if saves.stopped_at is not None:  # SIGTERM or Ctrl-C: what was measured is kept (--profile, --report)
        profiling.stop(ranks, metrics, steps_log.records)
        write_report(args, ranks, s, saves, layout_line(layout, args.world), stopped=saves.stop_line(args.save),
                     measured=profiling.html)
        return preempted(saves.stopped_at, saves.stopped_by, args, ranks, losses, metrics)
    run_seconds = time.perf_counter() - run_start
    ranks.at(args.steps, "end of the run (saving, validation, summary)")
    saves.finish()

    val = {k: v.to(args.device) for k, v in s.batches.sample("val").items()}
    if layout.pp == 1 and (layout.shard or layout.tp > 1):  # the parameters are pieces: the compiled step joins them
        with torch.no_grad():
            val_loss = s.opt_model(**val).item()
    elif layout.pp == 1:
        with torch.no_grad():
            val_loss = s.loss_fn(s.model.eval()(val["input_ids"]), val["labels"]).item()
    else:  # a rank holds one stage: the loss comes through the schedule, whose gradients are dropped
        val_loss = s.opt_model.forward_backward(**val).item()
        s.optimizer.zero_grad(set_to_none=True)
    tokens_per_s = run_tokens / run_seconds  # one replica's (one process's, or one pipeline's)
    report = s.opt_model.report
    ranks.say(f"\nsummary: {args.model or args.size}, {args.steps - s.start_step} steps of {args.batch} x {args.seq} "
              f"tokens on {args.device}, backend {args.backend}, passes {' '.join(s.passes) or '(none)'}")
    ranks.say(f"  loss {losses[0]:.3f} -> {losses[-1]:.3f}, first step to last (validation {val_loss:.3f})")
    if layout.dp > 1:  # replicas step in lockstep on batches of the same size
        ranks.say(f"  tokens/s across {layout.dp} data-parallel replicas: {tokens_per_s * layout.dp:,.0f}")
    ranks.say(f"  tokens/s{' per replica' if layout.dp > 1 else ''}: {tokens_per_s:,.0f} over the run "
              f"({run_tokens:,} tokens in {run_seconds:.1f}s), {history[-1]['tokens_per_s']:,.0f} in the last interval")
    tokens_per_call = args.batch // layout.microbatches * args.seq
    measured = throughput(s.model, s.opt_model, tokens_per_s, seq=args.seq, tokens_per_call=tokens_per_call,
                          device=args.device, layout=layout, total=ranks.total)
    ranks.say("  " + measured.line(layout))
    for line in filter(None, [s.batches.wait_line(run_seconds, args.steps - s.start_step), nonfinite.summary(),
                              *profiling.finish(ranks, metrics, steps_log.records)]):  # --profile: where the time went
        ranks.say(f"  {line}")
    findings = diagnose(steps_log.records)  # a healthy run's is empty, and says nothing
    for line in what_to_change(findings):
        ranks.say(f"  {line}")
    ranks.say(f"  picofx: capture {report.capture_seconds:.1f}s, compile {report.compile_seconds:.1f}s, "
              f"{report.recompilations} recompilations")
    ranks.say("\n" + report.table())
    write_report(args, ranks, s, saves, layout_line(layout, args.world), measured=profiling.html)
    if args.save:
        ranks.say(f"saved step {args.steps} to {args.save}/step-{args.steps} (continue with --resume {args.save} "
                  "and a larger --steps)")
    if metrics is not None:
        metrics.close()
    ranks.close()
    return {"history": history, "losses": losses, "val_loss": val_loss, "tokens_per_s": tokens_per_s,
            "throughput": measured, "skipped": nonfinite.skipped, "data_wait_s": s.batches.waited,
            "run_s": run_seconds, "findings": findings, "profile": profiling.measured}


def preempted(step: int, by: signal.Signals, args, ranks: Ranks, losses: list, metrics) -> dict:
    """SIGTERM or Ctrl-C: every rank stopped (and with --save saved) at `step`; the run ends here, to go
    on with --resume auto (exit status 0 after SIGTERM, 130 after Ctrl-C)."""
    what = "Ctrl-C" if by == signal.SIGINT else by.name
    where = (f"saved to {args.save}/step-{step} (continue with the same command and --resume auto)" if args.save
             else "nothing saved (pass --save DIR to checkpoint at the step boundary)")
    ranks.say(f"\npicofx train: stopped by {what} after step {step}, {where}")
    if metrics is not None:
        metrics.close()
    ranks.close()
    if by == signal.SIGINT:  # a rank with a process group can hang at interpreter exit
        os._exit(INTERRUPTED) if ranks.world > 1 else sys.exit(INTERRUPTED)
    return {"losses": losses, "preempted": step}


if __name__ == "__main__":
    main()
