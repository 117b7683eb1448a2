"""One run loop for every pipeline (reroll/pipelines/run.py), one table of pipelines
(reroll/config/pipelines.py): checked on the source with `ast`, so that a new pipeline plugs in
as a step and a table row, not as a loop of its own or a name tested in a far-away module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from reroll.config.pipelines import KINDS
from reroll.pipelines.run import step_factory

ROOT = Path(__file__).resolve().parents[2] / "reroll"
RUN_MODULE = ROOT / "pipelines" / "run.py"
TABLE = ROOT / "config" / "pipelines.py"

LIFECYCLE = {"for_run", "Tracker", "write_summary", "prune_checkpoints", "finished_summary",
             "writing_checkpoint"}
RUN_DIR_MODULE = ROOT / "pipelines" / "common.py"
CHECKPOINT_PARTS = {"staging_dir", "commit"}
"""The steps of `RunDir.writing_checkpoint`, called by it alone (and by the run module)."""
"""The run directory made or resumed, the tracker opened, checkpoints written and pruned, the
summary written: what each pipeline wrote again before there was one loop."""

NAME_ALLOWED = {(ROOT / "__init__.py", "sft")}
"""`reroll.sft` is the Python API's function, named like the pipeline it runs."""


def sources() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), str(path))) for path in sorted(ROOT.rglob("*.py"))]


def called_name(node: ast.Call) -> str | None:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


pytestmark = pytest.mark.unit


def test_the_run_lifecycle_is_called_only_in_the_run_module():
    found = [f"{path.relative_to(ROOT.parent)}:{node.lineno} {called_name(node)}"
             for path, tree in sources() if path != RUN_MODULE
             for node in ast.walk(tree)
             if isinstance(node, ast.Call) and (called_name(node) in LIFECYCLE or (
                 called_name(node) in CHECKPOINT_PARTS and path != RUN_DIR_MODULE))]
    assert found == []
    in_run = {called_name(node) for node in ast.walk(ast.parse(RUN_MODULE.read_text()))
              if isinstance(node, ast.Call)}
    assert LIFECYCLE <= in_run


def test_pipeline_names_are_written_only_in_the_table():
    """A pipeline's name as a string literal: only in the table, and in its config schema's own
    `pipeline:` and `name:` fields (the value a config file carries)."""
    found = []
    for path, tree in sources():
        if path == TABLE:
            continue
        fields = {id(n) for node in ast.walk(tree) if isinstance(node, ast.AnnAssign)
                  and isinstance(node.target, ast.Name) and node.target.id in ("pipeline", "name")
                  for n in ast.walk(node)}
        found += [f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.value!r}"
                  for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in KINDS
                  and id(node) not in fields and (path, node.value) not in NAME_ALLOWED]
    assert found == []


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_pipeline_has_a_step_factory_and_its_schema_names_it(name):
    kind = KINDS[name]
    assert callable(step_factory(name))
    assert kind.config.model_fields["pipeline"].default == name


def test_the_finish_message_names_the_run_s_algorithm():
    """`GRPO run finished` was printed for every RL algorithm: the title is the run's own."""
    from reroll.commands.run import finished_title

    assert finished_title("rlvr", {"algorithm": "rloo/cispo"}) == "rloo/cispo run finished"
    assert finished_title("dpo", {"algorithm": "DPO ipo"}) == "DPO ipo run finished"
    # a summary of an earlier version has no `algorithm`: the pipeline's title
    assert finished_title("rm", {}) == "reward model run finished"
