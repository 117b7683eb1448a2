"""`make gpu-check` (tools/gpu_check.py) on a machine without CUDA: a dry run that says what it
would run, within the 8 minutes a GPU check may take, on files and tests that exist."""

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).parents[1]
sys.path.insert(0, str(REPO / "tools"))
import gpu_check  # noqa: E402


def test_the_dry_run_names_every_part_within_the_budget(tmp_path, capsys):
    out = tmp_path / "gpu-check.json"
    assert gpu_check.main(["--dry-run", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["dry_run"] and set(record["parts"]) == {"tier", "smollm2_grpo", "real_model",
                                                          "vllm"}
    assert sum(p["limit_s"] for p in record["parts"].values()) <= 8 * 60
    printed = capsys.readouterr().out
    assert "nothing runs" in printed and "benchmarks/real_model.py --device cuda" in printed


def test_every_part_runs_what_exists():
    for part in gpu_check.parts(sys.executable, None):
        for command in part["commands"]:
            for arg in command:
                if arg.endswith((".yaml", ".py")) and "/" in arg and not arg.startswith("/"):
                    assert (REPO / arg).is_file(), arg
    path, name = gpu_check.VLLM_TEST.split("::")
    assert f"def {name}(" in (REPO / path).read_text()


def test_figures_read_from_each_part_output():
    tier = gpu_check.figures("tier", {"output_tail": "6 passed, 2 skipped in 39.1s"})
    assert tier == {"passed": 6, "skipped": 2}
    bench = gpu_check.figures("real_model", {"output_tail": 'table\n{"peak_gpu_gb": 4.4, '
                                                           '"update_chunked": {"s": 1}}'})
    assert bench == {"peak_gpu_gb": 4.4}
