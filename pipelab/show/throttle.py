"""`Throttle`: while values keep changing, redraw at most once per `gap_seconds`, always from the latest values.

Dragging a slider in JupyterLab sends a new value every few milliseconds.  Drawing each
one (tens of milliseconds) lets them queue up, and the picture trails the mouse by up to
a second.  Debouncing (drawing once the values stop changing) shows nothing while the
drag goes on.  A throttle draws the first change at once; changes that come while it is
not yet `gap_seconds` past the end of the last draw only book one draw for then, which
reads the values as they are by that time.  So a drag shows a picture every draw +
`gap_seconds`, and the last values are always drawn.

It needs the event loop the Jupyter kernel runs on (asyncio): outside a running loop (a
script, a test) every change is drawn at once.
"""

from __future__ import annotations

import asyncio
import math
from typing import Callable


class Throttle:
    def __init__(self, draw: Callable[[], None], gap_seconds: float = 0.04):
        self.draw, self.gap_seconds = draw, gap_seconds
        self.booked: asyncio.TimerHandle | None = None  # the draw to come, if one is booked
        self.booked_on: asyncio.AbstractEventLoop | None = None  # its loop (one that stopped never draws it)
        self.free_at = -math.inf  # loop time from which a change may draw at once
        self.draws = 0

    def __call__(self, *_) -> None:
        """A value changed: draw now, or book one draw for when the gap has passed."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._draw(None)
            return
        if self.booked is not None and self.booked_on is loop:
            return  # the booked draw will read these values
        wait = self.free_at - loop.time()
        if wait <= 0:
            self._draw(loop)
        else:
            self.booked, self.booked_on = loop.call_later(wait, self._draw, loop), loop

    def _draw(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.booked = None
        try:
            self.draw()
        finally:
            self.draws += 1
            if loop is not None:
                self.free_at = loop.time() + self.gap_seconds
