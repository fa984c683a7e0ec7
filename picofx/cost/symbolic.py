"""The cost model's predictions as sympy expressions in batch size B and sequence length T.

The step is predicted at a few sizes; its graphs have the same nodes at every size, only the
shapes differ. Every byte count and FLOP count of a node is a polynomial in B and T: degree 1
in B (everything is per sample, or shared) and at most 2 in T (attention scores and masks),
so with monomials 1, T, T², B, BT, BT² six sizes determine each one exactly (solved in exact
rational arithmetic), and one more size checks the fit. The live bytes at each moment of the
forward and backward are such polynomials too, so the peak is the maximum of them; the
expression keeps those that are the maximum somewhere on a grid of sizes.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import sympy


B, T = sympy.symbols("B T", positive=True, integer=True)
SIZES_BT = ((2, 16), (3, 16), (2, 32), (3, 32), (2, 48), (3, 48))
CHECK_BT = (4, 64)


def _monomials(vary_seq: bool):
    return [1, T, T**2, B, B * T, B * T**2] if vary_seq else [1, B]


@dataclass
class SymbolicStep:
    """Predictions as expressions in B (and T); `peak_at`/`largest_batch` evaluate them."""

    peak: sympy.Expr
    saved_activations: sympy.Expr
    flops: sympy.Expr
    seconds: sympy.Expr
    parameters: int
    gradients: int
    optimizer_state: int
    _resident: np.ndarray  # coefficients of the resident bytes (per monomial)
    _moments: np.ndarray  # (monomials, moments) coefficients of the live bytes above resident
    _vary_seq: bool

    def _basis(self, b: int, t: int) -> np.ndarray:
        return np.array([float(m.subs({B: b, T: t})) if not isinstance(m, int) else 1.0
                         for m in _monomials(self._vary_seq)])

    def peak_at(self, batch: int, seq: int = 0) -> int:
        basis = self._basis(batch, seq)
        return round(basis @ self._resident + (basis @ self._moments).max())

    def largest_batch(self, budget: int, limit: int = 1 << 16, seq: int = 0) -> int:
        """The largest batch ≤ limit whose peak ≤ budget (the peak grows with the batch); 0 if none."""
        low, high = 0, limit + 1
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self.peak_at(mid, seq) <= budget else (low, mid)
        return low


def _exact_fit(rows: list[list[int]], values: np.ndarray) -> list[list[Fraction]]:
    """Solve rows @ coefficients = values exactly (square system, one column per quantity)."""
    inverse = sympy.Matrix(rows).inv()
    inv = [[Fraction(int(x.p), int(x.q)) for x in inverse.row(i)] for i in range(inverse.rows)]
    return [[sum((inv[i][k] * int(values[k, j]) for k in range(len(rows))), Fraction(0))
             for j in range(values.shape[1])] for i in range(len(rows))]


def _poly(coefficients, monomials) -> sympy.Expr:
    return sum(sympy.Rational(c.numerator, c.denominator) * m for c, m in zip(coefficients, monomials))


def fit_samples(samples: list[dict], sizes, check, vary_seq: bool, cost_model) -> SymbolicStep:
    """Fit the step's predictions at `sizes` (and verify at `check`): `samples` holds, per size, the
    timelines' node targets ("shape") and live bytes, the StepMemory, and per node FLOPs, bytes
    moved and peak FLOP/s; `picofx.planner.predict.fit_step` collects them."""
    monomials = _monomials(vary_seq)
    if any(s["shape"] != samples[0]["shape"] for s in samples):
        raise ValueError("the step's graphs differ between sizes (a pass decides by size, or shapes "
                         "specialise the graph); predict each size with picofx.planner.predict.predict instead")

    def column(key):
        return np.array([[*([s["memory"].other_resident] if key == "resident" else []),
                          *([s["memory"].saved_activations] if key == "saved" else []),
                          *(s[key] if key not in ("resident", "saved") else [])] for s in samples], dtype=object)

    rows = [[int(m.subs({B: b, T: t})) if not isinstance(m, int) else 1 for m in monomials] for b, t in sizes]
    n = len(sizes)
    fits = {key: _exact_fit(rows, column(key)[:n]) for key in ("resident", "saved", "live", "flops", "moved")}
    if check:
        basis = [m.subs({B: check[0], T: check[1]}) if not isinstance(m, int) else 1 for m in monomials]
        for key, fit in fits.items():
            predicted = [sum(c[j] * x for c, x in zip(fit, basis)) for j in range(len(fit[0]))]
            if [int(x) for x in predicted] != [int(x) for x in column(key)[n]] or any(x.denominator != 1 for x in predicted):
                raise ValueError(f"the step's {key} bytes/FLOPs are not polynomials in B, T of degree (1, 2); "
                                 f"the fit misses the check size {check}")
    moments = np.array([[float(c) for c in row] for row in fits["live"]])
    resident = np.array([float(row[0]) for row in fits["resident"]])
    first = samples[0]["memory"]
    constants = first.parameters + first.optimizer_state
    step = SymbolicStep(sympy.Integer(0), _poly([r[0] for r in fits["saved"]], monomials), sympy.Integer(0),
                        sympy.Integer(0), first.parameters, first.gradients, first.optimizer_state,
                        resident + np.eye(len(monomials))[0] * constants, moments, vary_seq)
    step.peak = constants + _poly([r[0] for r in fits["resident"]], monomials) + sympy.Max(
        *[_poly([row[j] for row in fits["live"]], monomials) for j in _envelope(step)])
    flops = [_poly([row[j] for row in fits["flops"]], monomials) for j in range(len(fits["flops"][0]))]
    moved = [_poly([row[j] for row in fits["moved"]], monomials) for j in range(len(fits["moved"][0]))]
    step.flops = sympy.expand(sum(flops))
    terms = Counter(zip(flops, moved, samples[0]["peak_flops"]))
    bandwidth = cost_model.device.memory_bandwidth
    overhead = sympy.Float(cost_model.device.op_overhead)
    step.seconds = sum(count * (sympy.Max(f / sympy.Float(p), m / sympy.Float(bandwidth)) + overhead)
                       for (f, m, p), count in terms.items() if f != 0 or m != 0)
    return step


def _envelope(step: SymbolicStep) -> list[int]:
    """Moments that are the maximum at some size of a grid (B up to 4096, T up to 16384)."""
    seqs = [2**k for k in range(4, 15)] if step._vary_seq else [0]
    keep = set()
    for b in [2**k for k in range(13)]:
        for t in seqs:
            keep.add(int(np.argmax(step._basis(b, t) @ step._moments)))
    return sorted(keep)
