"""The loss trend: divergence (a non-finite loss, or the loss rising above where it started while the
gradient norm grows), spikes against a moving window, spikes right after the warm-up, and a plateau.

Every threshold compares a step with the run's own noise (medians and median absolute deviations
over a window of steps), so a noisy but healthy run raises nothing.
"""
from __future__ import annotations

from picofx.diagnose.finding import Finding, finite, median, number, spread

SPIKE_DEVIATIONS = 6.0   # a spike sits this many robust standard deviations above its window's median
SPIKE_RISE = 0.15        # ... and this fraction above it (a tiny spread alone flags no spike)
RISE = 1.02              # divergence: the recent loss above the first steps' by 2% ...
GRADIENT_GROWTH = 1.5    # ... while the gradient norm's median grew by half
PLATEAU_GAIN = 0.01      # a plateau: the last window's median loss surely (two standard errors) within 1%
PLATEAU_STEPS = 100      # ... judged on runs of at least this many steps


def window(steps: int) -> int:
    """Steps per moving window: a quarter of the run, 5 to 25."""
    return max(5, min(25, steps // 4))


def warmup_end(records: list[dict]) -> int | None:
    """The step the learning rate first reaches its peak, when it rose to it; None when it did not."""
    rates = [(r["step"], r["lr"]) for r in records if finite(r.get("lr"))]
    if len(rates) < 2 or rates[0][1] >= max(lr for _, lr in rates) * 0.99:
        return None
    peak = max(lr for _, lr in rates)
    return next(step for step, lr in rates if lr >= peak * 0.99)


def centred_medians(losses: list[float], half: int) -> list[float]:
    return [median(losses[max(0, i - half):i + half + 1]) for i in range(len(losses))]


def suggested_lr(records: list[dict], best: int) -> tuple[float, str]:
    """The lr to try, from the lr the loss was lowest at (`best`, an index): half of it when the lr rose
    after it (the warm-up went past what trains), a third of the peak when it had not changed."""
    peak = max(r["lr"] for r in records if finite(r.get("lr")))
    at_best = records[best].get("lr")
    if finite(at_best) and at_best < 0.99 * peak:
        return at_best / 2, (f"at most half the {number(at_best)} the loss was lowest at (step {records[best]['step']}),"
                             f" before the lr rose to {number(peak)}")
    return peak / 3, f"a third of {number(peak)}: the loss rose at that lr itself"


def divergence(records: list[dict]) -> Finding | None:
    bad = next((r for r in records if not finite(r.get("loss"))), None)
    if bad is not None:
        ok = [i for i, r in enumerate(records) if finite(r.get("loss")) and r["step"] < bad["step"]]
        lr, why = suggested_lr(records, min(ok, key=lambda i: records[i]["loss"])) if ok else (
            bad.get("lr", 0) / 10, "a tenth of it: no step before was finite")
        return Finding("divergence", (bad["step"], records[-1]["step"]),
                       f"the loss is not finite from step {bad['step']} (lr {number(bad.get('lr') or 0)})",
                       f"lower the learning rate to {number(lr)} ({why})", 0.95,
                       "finite losses; if it still diverges, the data or the model's numerics are next to check",
                       {"first_nonfinite_step": bad["step"], "lr": bad.get("lr"), "suggested_lr": lr})
    losses = [r["loss"] for r in records]
    if len(losses) < 10:
        return None
    w = window(len(losses))
    start, recent = median(losses[:min(5, w)]), median(losses[-w:])
    smoothed = centred_medians(losses, max(1, w // 5))
    best = min(range(len(losses) - w + 1), key=lambda i: smoothed[i])
    norms = [r.get("grad_norm") for r in records]
    growth = median(norms[-w:]) / median(norms[:w]) if median(norms[:w]) > 0 else float("nan")
    if not (recent > RISE * start and recent > RISE * smoothed[best] and finite(growth) and growth > GRADIENT_GROWTH):
        return None
    lr, why = suggested_lr(records, best)
    spikes = len(spike_steps(records))
    return Finding("divergence", (records[best]["step"], records[-1]["step"]),
                   f"the loss rose from {start:.3g} (median of the first steps) to {recent:.3g} (median of the last "
                   f"{w}) while the gradient norm grew {growth:.1f}x; {spikes} spike{'s' if spikes != 1 else ''}",
                   f"lower the learning rate to {number(lr)} ({why})", min(0.95, 0.6 + 0.1 * growth),
                   f"the loss falls below its first steps' {start:.3g} instead of climbing",
                   {"start_loss": start, "recent_loss": recent, "best_step": records[best]["step"],
                    "gradient_growth": growth, "spikes": spikes, "suggested_lr": lr})


def spike_steps(records: list[dict]) -> list[int]:
    """Indices of steps whose loss sits far above the median of the window before them, against the
    step-to-step noise (differences, so a falling trend does not widen it)."""
    losses = [r["loss"] for r in records]
    w, found = window(len(losses)), []
    for i in range(5, len(losses)):
        before = losses[max(0, i - w):i]
        centre = median(before)
        noise = spread([b - a for a, b in zip(before, before[1:])]) / 2 ** 0.5  # steps' noise, the trend aside
        if losses[i] > centre + max(SPIKE_DEVIATIONS * noise, SPIKE_RISE * abs(centre)):
            found.append(i)
    return found


def spikes(records: list[dict]) -> Finding | None:
    found = spike_steps(records)
    if not found:
        return None
    steps = [records[i]["step"] for i in found]
    worst = max(found, key=lambda i: records[i]["loss"])
    end = warmup_end(records)
    if end is not None and steps[0] <= 2 * end:
        return Finding("warmup", (steps[0], steps[-1]),
                       f"{len(steps)} loss spike{'s' if len(steps) > 1 else ''} in or right after the warm-up, which "
                       f"reaches the peak lr {number(records[-1]['lr'])} at step {end}",
                       f"a longer warm-up: ramp the lr over {2 * end} steps instead of {end}, or lower the peak lr",
                       0.6, "the early spikes go; the loss curve stays smooth past the warm-up",
                       {"spike_steps": steps, "warmup_steps": end})
    return Finding("loss_spikes", (steps[0], steps[-1]),
                   f"{len(steps)} loss spike{'s' if len(steps) > 1 else ''}, the largest {records[worst]['loss']:.3g} "
                   f"at step {records[worst]['step']}", f"lower the learning rate by a third (to "
                   f"{number(2 * records[-1]['lr'] / 3)}), or clip the gradient norm lower",
                   min(0.9, 0.4 + 0.1 * len(steps)), "fewer and smaller spikes", {"spike_steps": steps})


def plateau(records: list[dict]) -> Finding | None:
    if len(records) < PLATEAU_STEPS:
        return None
    w = max(20, len(records) // 5)
    losses = [r["loss"] for r in records[-2 * w:]]
    before, last = median(losses[:w]), median(losses[w:])
    gain = (before - last) / abs(before)
    noise = spread([b - a for a, b in zip(losses, losses[1:])]) / 2 ** 0.5
    error = 1.25 * noise * (2 / w) ** 0.5 / abs(before)  # the standard error of a difference of two medians
    if not (-PLATEAU_GAIN < gain and gain + 2 * error < PLATEAU_GAIN):  # a noisy loss may hide a slow descent
        return None
    return Finding("plateau", (records[-2 * w]["step"], records[-1]["step"]),
                   f"the loss stopped improving: median {before:.4g} then {last:.4g} over the last {2 * w} steps "
                   f"({100 * gain:+.2f}%)", f"decay the learning rate from {number(records[-1]['lr'])} (e.g. cosine to a "
                   "tenth of it), or a larger model if it is at its capacity for this data", 0.5,
                   "the loss goes on falling while the lr decays", {"gain": gain, "window": w})


def dynamics(records: list[dict]) -> list[Finding]:
    """Divergence supersedes the spikes it contains and a plateau (a rising loss is no plateau)."""
    diverged = divergence(records)
    if diverged is not None:
        return [diverged]
    finite_records = [r for r in records if finite(r.get("loss"))]
    return [f for f in (spikes(finite_records), plateau(finite_records)) if f is not None]
