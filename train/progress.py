"""Progress a person can read: whole lines with the count, the total, the rate and the time left.

No carriage returns and no bars: stage output goes through pipes (a training subprocess's lines are
forwarded by the runner), log files and CI logs, where a redrawn bar turns into `\\r`-joined fragments.
Lines go to a logger at INFO, so `--quiet` (WARNING) silences them like every other progress message.

    [distill] generate 320/1600 samples (20%), 41.2 samples/s, 31s left
    [pretrain] step 20/472 (4%), epoch 1/4, loss 4.444, lr 2.37e-03, 13.0k tokens/s, 1m52s left
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def duration(seconds: float) -> str:
    """`42s`, `3m07s`, `2h05m`: the two leading units."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def number(value: Any) -> str:
    """A field's value as a line shows it: floats with 4 significant digits, large rates as `13.0k`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if abs(value) >= 1e4:
        return f"{value / 1e3:.1f}k"
    if value != 0 and abs(value) < 1e-2:
        return f"{value:.2e}"
    return f"{value:.4g}"


class ProgressLine:
    """Counts work done out of `total` and logs one line every `every` units and at the end.

    `initial` is work done before this process started (a resumed run): the rate and the time left
    count only what this process did. Fields given to `update` are shown in order, after the count, as
    `name value`; a field named like a rate (`tokens/s`) as `value name`.
    """

    def __init__(
        self,
        label: str,
        total: int,
        unit: str,
        *,
        initial: int = 0,
        every: int | None = None,
        enabled: bool = True,
        verb: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label, self.total, self.unit, self.verb = label, total, unit, verb
        self.done = self.initial = initial
        self.every = every if every is not None else max(1, total // 20)
        self.enabled = enabled
        self.clock = clock
        self.started = clock()
        self.last_shown = initial

    def rate(self) -> float | None:
        """Units per second since this process started counting (None before the first unit)."""
        elapsed = self.clock() - self.started
        done = self.done - self.initial
        return done / elapsed if done > 0 and elapsed > 0 else None

    def text(self, **fields: Any) -> str:
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        what = f"{self.verb} " if self.verb else ""
        if self.unit == "step":
            count = f"step {self.done}/{self.total}{share}"
        else:
            count = f"{what}{self.done}/{self.total} {self.unit}s{share}"
        parts = [count] + [
            f"{number(value)} {name}" if name.endswith("/s") else f"{name.replace('_', ' ')} {number(value)}"
            for name, value in fields.items()
        ]
        rate = self.rate()
        if rate is not None:
            if self.unit != "step":
                parts.append(f"{number(rate)} {self.unit}s/s")
            parts.append(
                f"{duration((self.total - self.done) / rate)} left" if self.done < self.total else "done"
            )
        return f"[{self.label}] " + ", ".join(parts)

    def update(self, n: int = 1, **fields: Any) -> None:
        """Count `n` more units; log a line when `every` units passed since the last one, or at the end."""
        self.done += n
        if self.done - self.last_shown >= self.every or (self.done >= self.total > self.last_shown):
            self.show(**fields)

    def show(self, **fields: Any) -> None:
        """Log the line now."""
        self.last_shown = self.done
        if self.enabled:
            log.info("%s", self.text(**fields))
