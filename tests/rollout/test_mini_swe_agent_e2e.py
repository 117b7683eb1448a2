"""mini-swe-agent from PyPI, unmodified, trained through the gateway on terminal tasks:
`reroll train` with `agent: {entrypoint: reroll.rollout.gateway.mini_swe:solve}` on the tiny
model. mini-swe-agent drives the policy through the gateway's OpenAI endpoint (litellm), its
bash commands run in reroll's sandbox on the task's working directory, and each episode's reward
is the task's tests. The tiny model is first fitted to answer with one command (mini's
text-based action format), so that its commands really run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from tool_harness import fit_completions

from reroll.cli import main
from reroll.envs.terminal_gen import TerminalTask, write_suite

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(
    importlib.util.find_spec("minisweagent") is None,
    reason="mini-swe-agent is not installed: pip install 'reroll[mini-swe-agent]'")]

COMMAND = "touch done.txt && echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
REPLY = f"```mswea_bash_command\n{COMMAND}\n```"
# mini-swe-agent's own settings (its config's `agent` section), short for the tiny context.
MINI = {"agent": {"system_template": "Reply with one mswea_bash_command block.",
                  "instance_template": "{{task}}", "step_limit": 3}}


def fitted_model(tiny_model: str, out: Path, instructions: list[str], steps: int = 300) -> str:
    """The tiny model fitted to answer mini's first call on these instructions with REPLY (the
    prompts rendered as the gateway renders them; loss on the reply only)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reroll.rollout.gateway.chat import ChatRenderer

    shutil.copytree(tiny_model, out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    renderer = ChatRenderer(tokenizer)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    reply = renderer.encode(REPLY) + [tokenizer.eos_token_id]
    rows = [renderer.encode(renderer.render(
        [{"role": "system", "content": MINI["agent"]["system_template"]},
         {"role": "user", "content": text}], None, True)) for text in instructions]
    fit_completions(model, tokenizer.pad_token_id, [(p, reply) for p in rows], steps,
                    stop_below=0.005)
    model.save_pretrained(str(out))
    return str(out)


def test_mini_swe_agent_trains_on_terminal_tasks_through_the_gateway(tiny_model, tmp_path,
                                                                    monkeypatch):
    monkeypatch.chdir(tmp_path)  # the host's working directory: the agent must not touch it
    done = TerminalTask("make-done", "Create an empty file named done.txt.",
                        "#!/bin/bash\ntest -f done.txt\n").write(tmp_path / "tasks" / "make-done")
    write_suite(tmp_path / "suite", 1, 0, seed=0)
    generated = next((tmp_path / "suite" / "train").iterdir())
    rows = [{"task": str(done), "mini": MINI}, {"task": str(generated), "mini": MINI},
            # A harness that crashes: mini's template names a variable it does not have.
            {"task": str(done), "mini": {"agent": MINI["agent"] | {
                "instance_template": "{{ no_such_variable }}"}}}]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = fitted_model(tiny_model, tmp_path / "model", [
        Path(r["task"], "instruction.md").read_text().strip() for r in rows[:2]])
    config = {
        "pipeline": "agentic", "name": "mini", "output_dir": str(tmp_path / "run"),
        "steps": 1, "model": {"path": model},
        "agent": {"entrypoint": "reroll.rollout.gateway.mini_swe:solve", "tasks": str(tasks),
                  "time_limit_s": 120, "max_context_tokens": 768},
        "rollout": {"prompts_per_step": 3, "group_size": 2, "max_new_tokens": 96,
                    "temperature": 0.7},
        # Batch-whitened rewards: the fitted model's groups agree within themselves, not across.
        "algorithm": {"advantage": {"name": "reinforce_pp"}},
        "optimizer": {"lr": 1e-4},
        "train": {"micro_batch_size": 2, "num_threads": 1},
        "eval": {"every_steps": 0},
        "tracking": {"tensorboard": False, "progress": False, "record_rollouts": 6},
    }
    (tmp_path / "mini.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(tmp_path / "mini.yaml")]) == 0
    run = tmp_path / "run"
    [metrics] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                 if "gateway/episodes" in line]
    # Every episode ran mini-swe-agent; the crashing harness's two are counted as crashes.
    assert metrics["gateway/episodes"] == 6 and metrics["gateway/crashed"] == 2
    assert metrics["gateway/timeout"] == metrics["gateway/no_calls"] == 0
    assert metrics["gateway/faithful_fraction"] == 1.0  # its calls' tokens are what trains
    episodes = [json.loads(line) for line in (run / "rollouts" / "step_1.jsonl").open()]
    ran = [e for e in episodes if e["reward_info"]["agent_status"] == "ok"]
    assert len(ran) == 4 and all(e["reward_info"]["calls"] >= 1 for e in ran)
    # The command ran in the sandbox's working directory: the task's tests saw done.txt there
    # (reward 1), the host's working directory has none, and the generated task's tests fail.
    assert any(COMMAND in e["response"] and e["reward"] == 1.0 for e in ran), \
        [(e["prompt"][-300:], e["response"][:200]) for e in ran]
    assert not (tmp_path / "done.txt").exists()
    assert {e["reward"] for e in ran if "file named done.txt" not in e["prompt"]} == {0.0}
    crashed = [e for e in episodes if e["reward_info"]["agent_status"] == "crashed"]
    assert len(crashed) == 2 and "no_such_variable" in crashed[0]["reward_info"]["agent_error"]
    assert not any(e["response"] for e in crashed)  # nothing of a crash trains
    # The step trained on the tests' rewards (the crashes out of the loss).
    assert metrics["train/grad_norm"] > 0 and metrics["train/infra_groups_dropped"] == 1
    assert json.loads((run / "summary.json").read_text())["steps"] == 1


def test_mini_swe_agent_commands_run_in_the_task_sandbox(tmp_path, monkeypatch):
    """SandboxEnvironment, mini's environment class: a command's files land in the task's
    working directory in the sandbox (the next command and the tests see them), not on the host;
    shell state does not carry over; mini's submit command ends the run."""
    import asyncio

    from minisweagent.exceptions import Submitted

    from reroll.envs.terminal_tasks import TerminalTasksEnv
    from reroll.rollout.gateway.mini_swe import SandboxEnvironment

    monkeypatch.chdir(tmp_path)
    folder = TerminalTask("make-done", "Create done.txt.", "#!/bin/bash\ntest -f done.txt\n",
                          setup="echo seed > given.txt").write(tmp_path / "make-done")

    async def episode() -> tuple[list[dict], float]:
        workdir = TerminalTasksEnv(tasks=str(folder))
        await workdir.begin(workdir.train[0])
        env = SandboxEnvironment(workdir=workdir, loop=asyncio.get_running_loop(),
                                 env={"GREETING": "hi"})
        outs = await asyncio.to_thread(lambda: [env.execute({"command": c}) for c in (
            "cat given.txt && echo $GREETING > done.txt && cd /tmp", "cat done.txt; pwd")])
        with pytest.raises(Submitted):
            await asyncio.to_thread(env.execute,
                                    {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"})
        return outs, await workdir.verify()

    outs, reward = asyncio.run(episode())
    assert outs[0]["output"].strip() == "seed" and outs[0]["returncode"] == 0
    assert outs[1]["output"].splitlines()[0] == "hi" and outs[1]["output"].strip() != "/tmp"
    assert reward == 1.0 and not (tmp_path / "done.txt").exists()
