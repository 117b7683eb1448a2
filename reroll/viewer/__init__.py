"""`reroll view`: a self-contained HTML report of a run directory.

`load_run` reads the run directory, `render_report` / `write_report` make the page, and
`configure_view` / `cmd_view` are the CLI subcommand (registered by `reroll/cli.py`).
"""

from reroll.viewer.command import cmd_view, configure_view
from reroll.viewer.report import render_report, write_report
from reroll.viewer.rundata import RunData, load_run

__all__ = ["RunData", "configure_view", "cmd_view", "load_run", "render_report", "write_report"]
