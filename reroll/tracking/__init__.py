"""Metrics sinks: metrics.jsonl, tensorboard, and a rich progress bar."""

from reroll.tracking.tracker import ProgressBar, Tracker, read_metrics

__all__ = ["ProgressBar", "Tracker", "read_metrics"]
