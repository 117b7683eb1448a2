"""Restart-and-resume: when a worker process dies (a Ray actor killed, out of memory), stop every
role, build the pipeline again from the last checkpoint and carry on, at most
`distributed.max_restarts` times. Steps after that checkpoint are redone (the metrics file is
cut back to it on resume), so nothing before the checkpoint is lost; every step after a restart
carries `fault/restarts` and summary.json counts them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from reroll.distributed.cluster import is_worker_death
from reroll.pipelines.common import RunDir

log = logging.getLogger(__name__)


def supervise(make_pipeline: Callable[[Any], Any], config: Any) -> dict:
    restarts = 0
    while True:
        pipeline = None
        try:
            pipeline = make_pipeline(config)
            pipeline.restarts = restarts
            return pipeline.run()
        except Exception as error:
            if not is_worker_death(error) or restarts >= config.max_restarts():
                raise
            restarts += 1
            _stop(pipeline)
            resume = bool(RunDir(config.run_dir()).checkpoints())
            log.warning("a worker died (%s); restart %d of %d, %s", error, restarts,
                        config.max_restarts(),
                        "resuming from the last checkpoint" if resume else "from the start")
            # without a checkpoint, the failed attempt's files are cleared and it starts over
            config = config.model_copy(update={"resume": resume, "overwrite": not resume})


def _stop(pipeline: Any) -> None:
    """Best effort: the dead worker's peers and the tracker must not outlive the failed attempt."""
    if pipeline is None:
        return
    for close in (pipeline.tracker.close, pipeline.close):
        try:
            close()
        except Exception as e:  # noqa: BLE001 - the attempt already failed; keep restarting
            log.debug("while stopping the failed attempt: %s", e)
