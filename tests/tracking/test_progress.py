"""Progress when stderr is not a terminal: plain lines (step/total, status, elapsed, eta) at
the first and last step, every tenth of the run and every `interval_s` seconds."""

import io
import re
import time

from reroll.tracking import ProgressBar


def lines_of(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_plain_lines_at_start_end_and_every_tenth():
    stream = io.StringIO()
    bar = ProgressBar(100, "GRPO", enabled=True, stream=stream)
    for step in range(1, 101):
        bar.update(step, f"reward {step / 100:.3f}")
    bar.close()
    lines = lines_of(stream)
    steps = [int(re.match(r"GRPO step (\d+)/100 \| ", line).group(1)) for line in lines]
    assert steps == [1, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    assert lines[-1].startswith("GRPO step 100/100 | reward 1.000 | elapsed ")
    assert lines[-1].endswith("| eta 0s")


def test_a_slow_run_prints_every_interval_and_a_resumed_one_counts_from_its_start():
    stream = io.StringIO()
    bar = ProgressBar(1000, "SFT", start=500, enabled=True, interval_s=0.01, stream=stream)
    bar.update(501, "nll 2.0")
    bar.update(502, "nll 1.9")  # no tenth, too soon: no line
    time.sleep(0.02)
    bar.update(503, "nll 1.8")
    bar.close()
    assert [line.split(" | ")[0] for line in lines_of(stream)] == ["SFT step 501/1000",
                                                                   "SFT step 503/1000"]


def test_no_lines_when_progress_is_off():
    stream = io.StringIO()
    bar = ProgressBar(10, "GRPO", enabled=False, stream=stream)
    for step in range(1, 11):
        bar.update(step, "")
    assert stream.getvalue() == ""
