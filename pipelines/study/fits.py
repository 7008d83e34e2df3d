"""The shape of seed 003's token curve: speedup against finetune tokens fitted both as a + b log10(x) and
as a + b x, each fit reported (coefficients, slope standard error, R², residuals), so that the report can
say which shape the points follow instead of only that they rise."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from polydraft.pipelines.study.verdicts import _least_squares


class LineFit(BaseModel):
    """Least squares y = intercept + slope * f(x), for f = log10 or the identity."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shape: str
    """`log10(tokens)` or `tokens`."""
    intercept: float
    slope: float
    slope_se: float
    r2: float
    squared_residuals: list[float]
    """One per point, in the order of the points."""

    def text(self) -> str:
        return (
            f"speedup = {self.intercept:.4g} + {self.slope:.4g} {self.shape} (slope ± 2 SE "
            f"{self.slope:.4g} ± {2 * self.slope_se:.2g}), R² {self.r2:.3f}, mean squared residual "
            f"{sum(self.squared_residuals) / len(self.squared_residuals):.4g}"
        )


class ShapeFits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    log: LineFit
    linear: LineFit
    n: int
    budgets: int


def _fit(shape: str, xs: list[float], ys: list[float]) -> LineFit:
    intercept, slope, se, r2 = _least_squares(xs, ys)
    residuals = [(y - intercept - slope * x) ** 2 for x, y in zip(xs, ys)]
    return LineFit(
        shape=shape, intercept=intercept, slope=slope, slope_se=se, r2=r2, squared_residuals=residuals
    )


def shape_fits(xs: list[float], ys: list[float]) -> ShapeFits | None:
    """Both fits of the points (x > 0), or None with fewer than 3 points or 2 distinct x."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} x values against {len(ys)} y values")
    if len(xs) < 3 or len(set(xs)) < 2:
        return None
    if min(xs) <= 0:
        raise ValueError(f"token counts must be positive, got {min(xs)}")
    return ShapeFits(
        log=_fit("log10(tokens)", [math.log10(x) for x in xs], ys),
        linear=_fit("tokens", xs, ys),
        n=len(xs),
        budgets=len(set(xs)),
    )
