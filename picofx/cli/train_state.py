"""picofx train's --save and --resume: torch.distributed.checkpoint of what the run needs to go on
exactly as it would have gone: the parameters this process trains (a pipeline rank: its stages',
under the model's own names), AdamW's state, the learning-rate schedule, the step, the data
sampler's position of each replica and each rank's RNG. One process, data parallel and pipelined
runs all save to one directory, DIR/step-N (picofx.runtime.checkpoints: every --save-every steps and
at the end, in the background, and when SIGTERM asks); a run resumed with the same options continues
bit for bit."""
from __future__ import annotations

import contextlib
import signal
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from picofx.runtime.checkpoints import AsyncSaver, Preemption

# AdamW's state and hyperparameters keyed by parameter name: a pipeline rank's are its stages' own,
# and no key (such as a whole param_groups list) holds different values on different ranks.
BY_PARAMETER = StateDictOptions(flatten_optimizer_state_dict=True)
LOSSES = "loss_history"  # every step's loss from step 1 (rank 0's), for the report of a resumed run


def process_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@contextlib.contextmanager
def single_process_quiet():
    """dcp warns on every single-process save and load that it assumes one process: it is one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch.distributed is (disabled, )?unavailable or uninitialized",
                                category=UserWarning)
        yield


def trained_module(opt_model) -> torch.nn.Module:
    """The module whose parameters this process trains: the model, or this rank's pipeline stages."""
    return opt_model.pipeline.module if opt_model.pipeline is not None else opt_model


def run_state(opt_model, optimizer, scheduler, batches, *, step: int, replica: int) -> dict:
    """The state dict to save or to load into, keyed so that equal values on several ranks
    (replicas' parameters) are written once and each rank's own values have their own key."""
    model_state, optimizer_state = get_state_dict(trained_module(opt_model), optimizer, options=BY_PARAMETER)
    compression = {"compression": opt_model.compression} if opt_model.compression is not None else {}
    return {
        **compression,  # --compress: error-feedback residuals and PowerSGD's Q (a DCP Stateful)
        "model": model_state,
        "optimizer": optimizer_state,
        "schedule": {"last_epoch": torch.tensor(scheduler.last_epoch)},
        "step": torch.tensor(step),
        f"data_replica{replica}": batches.state_dict(),
        f"rng_rank{process_rank()}": torch.get_rng_state(),
    }


class PeriodicSaves:
    """--save DIR [--save-every N] [--keep K]: after a step, this run's state saved to DIR/step-N when
    it is due (every N steps, the last step) or when SIGTERM or Ctrl-C came to any rank (then the
    save is waited on, and the run stops there; `stopped_by` names the signal)."""

    def __init__(self, args, session, *, group, rank: int, replica: int, options: dict):
        self.args, self.session, self.replica, self.options, self.rank = args, session, replica, options, rank
        self.earlier = saved_losses(args.resume) if args.resume and rank == 0 else []  # the steps before this run's
        self.losses: list[float] = []  # this run's, appended by the loop
        self.first_step = session.start_step + 1 - len(self.earlier)  # > 1: an older checkpoint kept no losses
        self.saver = AsyncSaver(args.save, keep=args.keep, group=group, rank=rank) if args.save else None
        notice = (f"picofx train: Ctrl-C: {'saving' if args.save else 'writing what was measured'} at the end of this step, "
                  "then stopping (Ctrl-C again: stop now, unsaved)")
        # what a signal would lose (a checkpoint, the report, the profile's figures): the run stops at
        # the step boundary, every rank at the same one; without any of them a signal ends the run at once
        stops_at_a_step = args.save or args.report or args.profile
        self.preemption = Preemption(notice if rank == 0 else None).install() if stops_at_a_step else None
        self.stopped_at: int | None = None
        self.stopped_by = None  # the signal (SIGTERM or SIGINT) the run stopped for

    def after_step(self, step: int) -> bool:
        """Save if due; True when the run must stop here (preempted, saved on every rank with --save)."""
        if self.preemption is None:
            return False
        preempted = self.preemption.agreed()
        self.stopped_by = preempted
        due = step == self.args.steps or preempted or (self.args.save_every and step % self.args.save_every == 0)
        if self.saver is not None and due:
            s = self.session
            state = run_state(s.opt_model, s.optimizer, s.schedule, s.batches, step=step, replica=self.replica)
            with single_process_quiet():
                history = {LOSSES: self.history()} if self.rank == 0 else {}
                self.saver.save({**state, **history, "options": self.options}, step)
        if preempted is not None:
            self.stopped_at = step
            self.finish()
        return preempted is not None

    def history(self) -> list[float]:
        """Every step's loss from the run's first step, across resumes (rank 0's)."""
        return self.earlier + self.losses

    def stop_line(self, save: str) -> str:
        """What stopped the run early and where its state went."""
        what = "Ctrl-C" if self.stopped_by == signal.SIGINT else self.stopped_by.name
        where = f"saved to {save}/step-{self.stopped_at}" if save else "nothing saved (no --save)"
        return f"stopped by {what} after step {self.stopped_at}, {where}"

    def finish(self) -> None:
        """Wait for the save in flight; SIGTERM and Ctrl-C end the process again."""
        if self.saver is not None:
            with single_process_quiet():
                self.saver.wait()
        if self.preemption is not None:
            self.preemption.restore()


def saved_run(directory: str, option_names) -> tuple[int, dict]:
    """The step a checkpoint was saved at and the options it was saved with (read on this process
    alone, before any process group); an option the checkpoint does not hold is None."""
    state = {"step": torch.tensor(0), "options": {name: None for name in option_names}}
    with single_process_quiet():
        dcp.load(state, checkpoint_id=directory, no_dist=True, planner=DefaultLoadPlanner(allow_partial_load=True))
    return int(state["step"]), state["options"]


def saved_losses(directory: str) -> list[float]:
    """The losses a checkpoint holds from the run's first step to its own ([] where it holds none)."""
    state = {LOSSES: None}
    with single_process_quiet():
        dcp.load(state, checkpoint_id=directory, no_dist=True, planner=DefaultLoadPlanner(allow_partial_load=True))
    return list(state[LOSSES] or [])


def resume_disagreement(resume: str | None, group) -> str | None:
    """Every rank's resolved --resume (a directory, or None for a fresh start) compared on `group`:
    the error every rank stops with where they differ (a checkpoint still being written when they
    looked), else None. One process: None."""
    if not dist.is_initialized():
        return None
    chosen: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(chosen, resume, group=group)
    if len(set(chosen)) == 1:
        return None
    each = ", ".join(f"rank {rank}: {c or 'a fresh start'}" for rank, c in enumerate(chosen))
    return (f"--resume: the ranks found different checkpoints to continue from ({each}); one was still being "
            "written when they looked: start again once every rank of the run before has exited")


def resume(directory: str, opt_model, optimizer, scheduler, batches, *, replica: int) -> int:
    """Load a --save checkpoint into the run, in place (the compiled step holds the parameters
    themselves); returns the step to continue from."""
    state = run_state(opt_model, optimizer, scheduler, batches, step=0, replica=replica)
    with single_process_quiet():
        dcp.load(state, checkpoint_id=directory, no_dist=not dist.is_initialized())
    set_state_dict(trained_module(opt_model), optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=BY_PARAMETER)
    scheduler.last_epoch = int(state["schedule"]["last_epoch"])
    batches.load_state_dict(state[f"data_replica{replica}"])
    torch.set_rng_state(state[f"rng_rank{process_rank()}"])
    return int(state["step"])
