"""Pictures and widgets: timelines and memory plots of a `Trace`, and the explorer's sliders wired
to plain functions (`simulate`, the plots).  Imports everything below it (runtime, prediction, the
model side, the schedule IR); the engine never imports this package."""
