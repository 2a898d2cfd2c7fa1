"""Where a run's numbers go: ``metrics.jsonl`` (``metrics``), the experiment trackers of
``run.report_to`` (``trackers``, ``backends``), the learning-curve pictures (``pictures``), all
behind ``RunReport`` (``report``)."""

from relayrl.tracking.metrics import MetricsLog, ProgressBar, Timers
from relayrl.tracking.report import RunReport
from relayrl.tracking.trackers import TrackerError, Trackers

__all__ = ["MetricsLog", "ProgressBar", "RunReport", "Timers", "TrackerError", "Trackers"]
