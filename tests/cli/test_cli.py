import json
import shutil
import subprocess
import sys

import pytest

from reroll.cli import build_parser, main

pytestmark = pytest.mark.unit


def test_help_lists_every_subcommand():
    text = build_parser().format_help()
    for command in ("train", "sft", "make-model", "make-data", "view"):
        assert command in text


def test_make_data_writes_splits(tmp_path, capsys):
    assert main(["make-data", "--out", str(tmp_path), "--train-size", "20", "--eval-size", "5",
                 "--levels", "1,3", "--direct-frac", "1", "--direct-accuracy", "1"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").open()]
    assert len(rows) == 20 and {r["level"] for r in rows} <= {1, 3}
    assert all(r["response"] == f"The answer is \\boxed{{{r['answer']}}}." for r in rows)


@pytest.mark.parametrize("flags, problem", [(["--levels", "1,7"], "--levels"),
                                            (["--direct-frac", "2"], "--direct-frac")])
def test_make_data_rejects_bad_flags(tmp_path, capsys, flags, problem):
    assert main(["make-data", "--out", str(tmp_path), *flags]) == 2
    assert problem in capsys.readouterr().err


def test_missing_model_exits_2_naming_the_fix(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(f"steps: 1\nmodel: {{path: {tmp_path / 'nope'}}}\ndata: {{train: x.jsonl}}\n")
    result = subprocess.run([sys.executable, "-m", "reroll.cli", "train", str(config)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "reroll make-model" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", [["train", "examples/arithmetic/grpo.yaml"],
                                     ["dpo", "examples/preferences/dpo.yaml"],
                                     ["sft", "examples/arithmetic/sft.yaml"]],
                         ids=lambda c: c[0])
def test_a_wrong_model_path_is_refused_before_torch_is_imported(command):
    """It took 30-55 s under load: the CLI imported torch (through `reroll export` and
    transformers' logging) before the pipeline loaded the model and found the folder missing."""
    from pathlib import Path

    code = ("import sys; from reroll.cli import main; "
            f"rc = main({[*command, 'model.path=/no/such/model']!r}); "
            "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert result.stdout.split() == ["2", "False", "False"], result.stdout + result.stderr
    assert "model.path /no/such/model: no Hugging Face model there" in result.stderr


def test_make_model_keeps_a_model_already_there(tmp_path, tiny_model, capsys):
    """Issue 49: `make-model --out` over a trained model replaced it with random weights."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    weights = (model / "model.safetensors").read_bytes()
    assert main(["make-model", "--out", str(model)]) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert (model / "model.safetensors").read_bytes() == weights
    assert main(["make-model", "--out", str(model), "--from-gguf", "x.gguf"]) == 2


def test_make_model_says_when_the_vocabulary_is_smaller_than_asked(tmp_path, tiny_model, capsys):
    """Issue 49: --vocab-size 600 wrote a 529-token model without a word (the built-in corpus
    has no more merges); --overwrite replaces the folder."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    assert main(["make-model", "--out", str(model), "--overwrite", "--vocab-size", "600",
                 "--hidden-size", "32", "--num-layers", "1"]) == 0
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    err = capsys.readouterr().err
    assert vocab < 600 and f"the vocabulary has {vocab} tokens, not 600" in err


def test_make_data_keeps_the_files_already_there(tmp_path, capsys):
    """Issue 49: `make-data --out` rewrote existing train.jsonl and eval.jsonl."""
    (tmp_path / "train.jsonl").write_text('{"prompt": "mine", "answer": "1"}\n')
    (tmp_path / "notes.txt").write_text("other files in the folder are no reason to refuse")
    args = ["make-data", "--out", str(tmp_path), "--train-size", "4", "--eval-size", "2"]
    assert main(args) == 2
    assert "train.jsonl exists there; pass --overwrite" in capsys.readouterr().err
    assert "mine" in (tmp_path / "train.jsonl").read_text()
    assert main([*args, "--overwrite"]) == 0
    assert "mine" not in (tmp_path / "train.jsonl").read_text()


def test_every_command_is_in_the_table_and_cli_imports_nothing_inside_a_function():
    """One table (`COMMANDS`) says where each command lives; the CLI module itself defers no
    import (each command's module is imported only when that command runs)."""
    import ast
    from pathlib import Path

    from reroll import cli

    names = [c.name for c in cli.COMMANDS]
    assert len(names) == len(set(names))
    subparsers = build_parser()._subparsers._group_actions[0].choices
    assert list(subparsers) == names
    assert all(any(a.dest != "help" for a in p._actions) for p in subparsers.values())
    tree = ast.parse(Path(cli.__file__).read_text())
    nested = [node.lineno for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)
              for node in ast.walk(fn) if isinstance(node, ast.Import | ast.ImportFrom)]
    assert nested == []


def test_help_and_one_command_load_only_that_commands_module():
    code = ("import sys; from reroll.cli import main\n"
            "try: main(['--help'])\nexcept SystemExit: pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('reroll.commands.')), "
            "'torch' in sys.modules)\n"
            "main(['make-data', '--out', sys.argv[1], '--train-size', '2', '--eval-size', '1'])\n"
            "print(sorted(m for m in sys.modules if m.startswith('reroll.commands.')))")
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        result = subprocess.run([sys.executable, "-c", code, out], capture_output=True,
                                text=True, timeout=120)
    lines = result.stdout.strip().splitlines()
    assert lines[-2].endswith("['reroll.commands.common'] False"), result.stdout + result.stderr
    assert lines[-1] == "['reroll.commands.common', 'reroll.commands.data']"
