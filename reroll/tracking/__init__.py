"""Metrics sinks: metrics.jsonl, tensorboard, wandb, trackio, and a rich progress bar."""

from reroll.tracking.remote import TrackerError
from reroll.tracking.tracker import ProgressBar, Tracker, read_metrics

__all__ = ["ProgressBar", "Tracker", "TrackerError", "read_metrics"]
