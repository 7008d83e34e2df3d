"""The shape of seed 003's token curve: speedup against finetune tokens fitted both as a + b log10(x) and
as a + b x, each fit reported (coefficients, slope standard error, R², AIC), and the two shapes compared
by how well each predicts prompts it was not fitted on (`held_out_errors`), per prompt, so that the study's
one paired rule can judge which shape the points follow."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from polydraft.pipelines.study.verdicts import ArmValues, Prompt

Point = tuple[float, float]
"""(finetune tokens, speedup)."""
PromptPoints = dict[int, dict[Prompt, list[Point]]]
"""Training seed -> prompt -> the prompt's point at each finetune budget."""
SHAPES = {"log10(tokens)": math.log10, "tokens": float}


def _least_squares(xs: list[float], ys: list[float]) -> tuple[float, float, float, float]:
    """(intercept, slope, slope standard error, R^2) of y on x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx
    intercept = my - slope * mx
    residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
    total = sum((y - my) ** 2 for y in ys)
    se = math.sqrt(residual / (n - 2) / sxx) if n > 2 else float("inf")
    return intercept, slope, se, (1 - residual / total) if total > 0 else 1.0


class LineFit(BaseModel):
    """Least squares y = intercept + slope * f(x), for f = log10 or the identity."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shape: str
    """`log10(tokens)` or `tokens`."""
    intercept: float
    slope: float
    slope_se: float
    r2: float
    aic: float
    """n ln(RSS / n) + 4 (two parameters): the lower, the better the shape (both fits have as many)."""
    squared_residuals: list[float]
    """One per point, in the order of the points."""

    def predict(self, x: float) -> float:
        return self.intercept + self.slope * SHAPES[self.shape](x)

    def text(self) -> str:
        return (
            f"speedup = {self.intercept:.4g} + {self.slope:.4g} {self.shape} (slope ± 2 SE "
            f"{self.slope:.4g} ± {2 * self.slope_se:.2g}), R² {self.r2:.3f}, AIC {self.aic:.1f}"
        )


class ShapeFits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    log: LineFit
    linear: LineFit
    n: int
    budgets: int


def _fit(shape: str, xs: list[float], ys: list[float]) -> LineFit:
    transformed = [SHAPES[shape](x) for x in xs]
    intercept, slope, se, r2 = _least_squares(transformed, ys)
    residuals = [(y - intercept - slope * x) ** 2 for x, y in zip(transformed, ys)]
    aic = len(xs) * math.log(max(sum(residuals), 1e-300) / len(xs)) + 4
    return LineFit(
        shape=shape,
        intercept=intercept,
        slope=slope,
        slope_se=se,
        r2=r2,
        aic=aic,
        squared_residuals=residuals,
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
        log=_fit("log10(tokens)", xs, ys), linear=_fit("tokens", xs, ys), n=len(xs), budgets=len(set(xs))
    )


def held_out_errors(points: PromptPoints) -> tuple[ArmValues, ArmValues]:
    """(linear, log): per prompt, the mean squared error of each shape fitted on every other prompt's points
    and predicting this prompt's (leave one prompt out); a prompt whose rest cannot be fitted is left out."""
    linear: dict[int, dict[Prompt, float]] = {seed: {} for seed in points}
    log: dict[int, dict[Prompt, float]] = {seed: {} for seed in points}
    for seed, by_prompt in points.items():
        for prompt, own in by_prompt.items():
            rest = [
                p
                for s, other in points.items()
                for q, ps in other.items()
                if (s, q) != (seed, prompt)
                for p in ps
            ]
            fits = shape_fits([x for x, _ in rest], [y for _, y in rest])
            if fits is None or not own:
                continue
            for errors, fit in ((linear, fits.linear), (log, fits.log)):
                errors[seed][prompt] = sum((y - fit.predict(x)) ** 2 for x, y in own) / len(own)
    return linear, log
