"""mini-swe-agent (`pip install mini-swe-agent`) on terminal tasks, trained through the gateway:
`agent: {entrypoint: "reroll.rollout.gateway.mini_swe:solve"}` with task rows naming task
folders (docs/agentic.md, docs/terminal-tasks.md).

The harness is mini-swe-agent's own `DefaultAgent`, unmodified, set up only through its
documented config (a config file as `mini -c` reads, here `mini_textbased.yaml` unless a row names
another) and its extension points: the model is its litellm text-based model pointed at the
episode's gateway URL (`openai/<name>` with `api_base`), and the environment is
`SandboxEnvironment` (its `environment_class`), which runs each bash command in reroll's sandbox
on the task's working directory instead of on the host. The episode's reward is the task's
tests (tests/test.sh), run on that directory after the agent stops.

A task row: `{"task": "path/to/task-folder", "config": "my-mini.yaml", "mini": {...}}`;
`config` (optional) is a mini-swe-agent config file, `mini` (optional) settings merged over it
(its `agent`, `model` and `environment` sections: templates, `step_limit`, `timeout`, ...).
"""

from __future__ import annotations

import asyncio
import shlex
from pathlib import Path
from typing import Any

import yaml

from reroll import settings
from reroll.envs.terminal_tasks import TerminalTasksEnv

# mini-swe-agent's and litellm's documented switches, set unless the user set them: no banner,
# no download of litellm's price table (no network in a run), no cost accounting (the gateway's
# model has no price), and few retries (a refused call is the episode's end, not a hiccup).
settings.defaults({"MSWEA_SILENT_STARTUP": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                   "MSWEA_COST_TRACKING": "ignore_errors",
                   "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "2"})

try:  # after its switches above
    import litellm
    from minisweagent import package_dir
    from minisweagent.agents import get_agent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models import get_model
    from minisweagent.utils.serialize import recursive_merge
except ImportError as e:
    raise ImportError(f"{e}: this harness needs mini-swe-agent "
                      "(pip install 'reroll[mini-swe-agent]')") from None
litellm.suppress_debug_info = True  # its notes on the gateway's unpriced model are noise

DEFAULT_CONFIG = package_dir / "config" / "mini_textbased.yaml"
"""mini-swe-agent's config for models without tool calling (a ```mswea_bash_command block per
reply); a model that calls tools can use `mini.yaml` with `model_class: litellm`."""
MAX_OUTPUT_CHARS = 10_000
"""A command's output is cut here (mini's templates warn the model past this length)."""


class SandboxEnvironment(LocalEnvironment):
    """mini-swe-agent's environment, its commands run in reroll's sandbox: each in a one-shot
    sandbox on the task's working directory (`TerminalTasksEnv.shell`: files persist between
    commands, shell state does not, as mini's templates tell the model). Its settings are
    `LocalEnvironment`'s (`env`, `timeout`; `cwd` is the task's directory)."""

    def __init__(self, *, workdir: TerminalTasksEnv, loop: asyncio.AbstractEventLoop, **kwargs):
        super().__init__(**kwargs)
        self.workdir, self.loop = workdir, loop
        workdir.command_timeout_s = float(self.config.timeout)

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict:
        exports = "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in self.config.env.items())
        command = exports + action.get("command", "")
        # The agent runs on a worker thread; the sandbox belongs to the episode's event loop.
        output, status = asyncio.run_coroutine_threadsafe(self.workdir.shell(command),
                                                          self.loop).result()
        result = {"output": output, "returncode": status, "exception_info": ""}
        self._check_finished(result)  # mini's submit command ends the run (raises Submitted)
        return result


def mini_config(task: dict) -> dict:
    """The row's mini-swe-agent config: its file (or the default) with `mini` merged over."""
    path = Path(task.get("config") or DEFAULT_CONFIG)
    return recursive_merge(yaml.safe_load(path.read_text()) or {}, task.get("mini") or {})


async def solve(task: dict[str, Any], base_url: str, api_key: str) -> float:
    """One episode: mini-swe-agent on the row's task folder through the gateway at `base_url`;
    the task's tests' reward. The set-up failing, or the agent raising, fails the episode as a
    crash (an infrastructure failure, not a reward of 0)."""
    config = mini_config(task)
    workdir = TerminalTasksEnv(tasks=task["task"], max_output_chars=MAX_OUTPUT_CHARS)
    await workdir.begin(workdir.train[0])
    env_config = {k: v for k, v in config.get("environment", {}).items()
                  if k not in ("environment_class", "cwd")}
    env = SandboxEnvironment(workdir=workdir, loop=asyncio.get_running_loop(), **env_config)
    # The gateway serves one model whatever the name; `openai/` makes litellm speak OpenAI's API.
    model_config = recursive_merge(config.get("model", {}), {
        "model_class": config.get("model", {}).get("model_class", "litellm_textbased"),
        "model_name": "openai/policy",
        "model_kwargs": {"api_base": base_url, "api_key": api_key}})
    agent_config = {k: v for k, v in config.get("agent", {}).items() if k != "mode"}
    agent = get_agent(get_model(config=model_config), env, agent_config, default_type="default")
    # mini's agent is synchronous: it runs on a thread while this loop runs its commands.
    try:
        await asyncio.to_thread(agent.run, workdir.task.instruction.strip())
    except litellm.ContextWindowExceededError:
        pass  # the policy filled its context: its episode ends, and the tests judge it
    return await workdir.verify()
