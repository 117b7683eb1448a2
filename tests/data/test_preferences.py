"""Preference pairs: accepted formats, malformed pairs named by file and line, the arithmetic set."""

import json
import re

import pytest

from reroll.cli import main
from reroll.config.errors import ConfigError
from reroll.data.preferences import (
    arithmetic_preference_rows,
    load_preferences,
    write_arithmetic_preferences,
)
from reroll.rewards.math import verify_boxed

pytestmark = pytest.mark.unit

GOOD = {"prompt": "2 + 2?", "chosen": "4", "rejected": "5"}


def write(tmp_path, *rows) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_prompt_and_messages_rows_with_string_or_message_responses(tmp_path):
    path = write(tmp_path, GOOD, {
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "3 + 3?"}],
        "chosen": [{"role": "assistant", "content": "6"}],
        "rejected": [{"role": "assistant", "content": "7"}]})
    rows = load_preferences(path, system_prompt="S")
    assert [(r.chosen, r.rejected) for r in rows] == [("4", "5"), ("6", "7")]
    assert rows[0].prompt.messages[0] == {"role": "system", "content": "S"}
    assert rows[1].prompt.messages[0]["content"] == "Be brief."
    assert rows[1].prompt.source.endswith("pairs.jsonl:2")


@pytest.mark.parametrize("bad, problem", [
    ({"prompt": "q", "chosen": "", "rejected": "b"}, "`chosen` is empty"),
    ({"prompt": "q", "chosen": "  ", "rejected": "b"}, "`chosen` is empty"),
    ({"prompt": "q", "chosen": "a", "rejected": "a "}, "are the same response"),
    ({"prompt": "q", "chosen": "a"}, "missing `rejected`"),
    ({"chosen": "a", "rejected": "b"}, "needs a non-empty string `prompt`"),
    ({"prompt": "q", "chosen": 3, "rejected": "b"}, "`chosen` must be a string"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "chosen": "a", "rejected": "b"}, "must end before the answer"),
])
def test_malformed_pairs_name_file_and_line(tmp_path, bad, problem):
    path = write(tmp_path, GOOD, bad)
    with pytest.raises(ConfigError) as error:
        load_preferences(path)
    assert f"{path}:2" in str(error.value) and problem in str(error.value)


def test_the_first_malformed_pair_is_named_before_a_later_broken_line(tmp_path):
    path = write(tmp_path, GOOD, {"prompt": "q", "chosen": "a", "rejected": "a"})
    with open(path, "a") as f:
        f.write("{not json\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}:2: `chosen` and `rejected` are the same")):
        load_preferences(path)


def test_a_malformed_pair_exits_2_from_the_cli(tmp_path, capsys, tiny_model):
    data = write(tmp_path, GOOD, {"prompt": "q", "chosen": "same", "rejected": "same"})
    config = tmp_path / "dpo.yaml"
    config.write_text(f"pipeline: dpo\noutput_dir: {tmp_path / 'run'}\nmodel: {{path: {tiny_model}}}\n"
                      f"data: {{train: {data}}}\ntrain: {{micro_batch_size: 2}}\n")
    assert main(["dpo", str(config)]) == 2
    err = capsys.readouterr().err
    assert "pairs.jsonl:2" in err and "same response" in err and "Traceback" not in err


def test_arithmetic_pairs_prefer_the_right_answer():
    for row in arithmetic_preference_rows(30, seed=3):
        assert verify_boxed(row["chosen"], row["answer"])[0] == 1.0
        assert verify_boxed(row["rejected"], row["answer"])[0] == 0.0


def test_make_data_preferences_writes_disjoint_splits(tmp_path):
    assert main(["make-data", "--preferences", "--out", str(tmp_path), "--train-size", "40",
                 "--eval-size", "10"]) == 0
    train, held_out = (load_preferences(tmp_path / f"{s}.jsonl") for s in ("train", "eval"))
    assert len(train) == 40 and len(held_out) == 10
    assert not {r.prompt.prompt_text for r in train} & {r.prompt.prompt_text for r in held_out}
    assert write_arithmetic_preferences(tmp_path / "again", 40, 10)["train"].read_text() == \
        (tmp_path / "train.jsonl").read_text()


def test_judge_rows_randomise_order_and_the_math_reward_scores_agreement():
    from reroll.data.preferences import judge_rows
    pairs = arithmetic_preference_rows(200, seed=0)
    rows = judge_rows(pairs, seed=0)
    assert rows == judge_rows(pairs, seed=0)
    letters = [r["answer"] for r in rows]
    assert 60 < letters.count("A") < 140
    for pair, row in zip(pairs, rows, strict=True):
        first = row["prompt"].index("Response A:")
        second = row["prompt"].index("Response B:")
        shown_a = row["prompt"][first:second]
        assert (pair["chosen"] in shown_a) == (row["answer"] == "A")
        assert verify_boxed(row["response"], row["answer"])[0] == 1.0  # the right verdict
    # The format-only warm-up's target: a verdict in the reply format whose letter says nothing
    # of the answer (about half of its letters agree with it, about half are A).
    guesses = [r["format_response"].removeprefix("The answer is \\boxed{").removesuffix("}.")
               for r in rows]
    assert set(guesses) == {"A", "B"} and 70 < guesses.count("A") < 130
    agree = sum(g == r["answer"] for g, r in zip(guesses, rows, strict=True))
    assert 70 < agree < 130
    assert verify_boxed("\\boxed{A}", "A")[0] == 1.0
    assert verify_boxed("\\boxed{B}", "A")[0] == 0.0


def test_make_data_judge_writes_judge_splits(tmp_path):
    main(["make-data", "--judge", "--out", str(tmp_path), "--train-size", "20",
          "--eval-size", "5"])
    for split, n in (("train", 20), ("eval", 5)):
        rows = [json.loads(line) for line in (tmp_path / f"{split}.jsonl").read_text().splitlines()]
        assert len(rows) == n
        assert all(r["answer"] in ("A", "B") and "Response B:" in r["prompt"] for r in rows)


def sample(prompt, response, reward, finish="stop"):
    return {"prompt": prompt, "response": response, "reward": reward, "finish_reason": finish}


def sample_preference_rows(samples, threshold=1.0, pairs_per_prompt=2, seed=0) -> list[dict]:
    from reroll.data.preferences import sample_preference_pairs

    return [row for _, row in sample_preference_pairs(samples, threshold, pairs_per_prompt, seed)]


def test_pairs_from_verified_samples_pair_right_with_wrong_of_the_same_prompt():
    samples = [sample("p1", "r1", 1.0), sample("p1", "w1", 0.0), sample("p1", "w1", 0.0),
               sample("p1", "r2", 1.0), sample("p1", "w2", 0.0), sample("p1", "w3", 0.0),
               sample("p2", "r", 1.0), sample("p2", "r", 1.0),            # all right: no pair
               sample("p3", "w", 0.0), sample("p3", "cut", 1.0, "length"),  # cut: left out
               sample("p4", "half", 0.5), sample("p4", "right", 1.0)]
    rows = sample_preference_rows(samples, threshold=1.0, pairs_per_prompt=2, seed=0)
    assert rows == sample_preference_rows(samples, threshold=1.0, pairs_per_prompt=2, seed=0)
    assert [r["prompt"] for r in rows] == ["p1", "p1", "p4"]
    p1 = rows[:2]
    assert {r["chosen"] for r in p1} == {"r1", "r2"}
    assert len({r["rejected"] for r in p1}) == 2 and {r["rejected"] for r in p1} <= {"w1", "w2", "w3"}
    assert rows[2] == {"prompt": "p4", "chosen": "right", "rejected": "half"}
    assert [r["prompt"] for r in sample_preference_rows(samples, 0.5, 1)] == ["p1"]  # p4 all right


def test_make_data_preferences_from_samples_holds_out_whole_prompts(tmp_path, capsys):
    rows = [sample(f"q{i}", f"right {i} {k}", 1.0) for i in range(30) for k in range(2)] + \
           [sample(f"q{i}", f"wrong {i} {k}", 0.0) for i in range(30) for k in range(3)]
    samples = tmp_path / "model-eval.samples.jsonl"
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["make-data", "--preferences-from", str(samples), "--out", str(tmp_path / "p"),
                 "--eval-size", "10"]) == 0
    train, held_out = (load_preferences(tmp_path / "p" / f"{s}.jsonl") for s in ("train", "eval"))
    assert len(held_out) == 10 and len(train) == 50
    assert not {r.prompt.prompt_text for r in train} & {r.prompt.prompt_text for r in held_out}
    assert all(r.chosen.startswith("right") and r.rejected.startswith("wrong")
               for r in train + held_out)
    samples.write_text(json.dumps(sample("q", "r", 1.0)) + "\n{\"prompt\": \"q\"}\n")
    assert main(["make-data", "--preferences-from", str(samples), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "model-eval.samples.jsonl:2" in err and "Traceback" not in err


def test_judge_labels_from_samples_are_balanced_judge_prompts(tmp_path):
    from reroll.config.rewards import JUDGE_TEMPLATE
    from reroll.data.preferences import judge_label_rows
    samples = [sample(f"q{i}", f"r{i}{k}", float(k == 0)) | {"answer": str(i)}
               for i in range(20) for k in range(3)] + [sample("q0", "r00", 1.0)]  # a repeat
    rows = judge_label_rows(samples, JUDGE_TEMPLATE)
    assert len(rows) == 40 and [r["response"] for r in rows].count("yes") == 20
    for row in rows:
        i, k = row["question"][1:], row["prompt"].split("Response: r")[1][len(row["question"]) - 1]
        assert f"Reference answer: {i}\n" in row["prompt"]
        assert row["response"] == row["answer"] == ("yes" if k == "0" else "no")
    assert main(["make-data", "--judge-labels-from", str(write_samples(tmp_path, samples)),
                 "--out", str(tmp_path / "j"), "--eval-size", "6"]) == 0
    train, held_out = ([json.loads(x) for x in (tmp_path / "j" / f"{s}.jsonl").read_text()
                        .splitlines()] for s in ("train", "eval"))
    assert len(train) + len(held_out) == 40 and len(held_out) >= 6
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}


def write_samples(tmp_path, samples):
    path = tmp_path / "m.samples.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    return path
