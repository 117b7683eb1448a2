import asyncio
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from reroll.config import ConfigError
from reroll.data.batch import Trajectory, collate, split_micro_batches
from reroll.data.datasets import PromptSampler, load_prompts
from reroll.data.tasks import arithmetic_rows, write_arithmetic

pytestmark = pytest.mark.unit


def test_jsonl_rows_with_prompt_or_messages(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "2+2?", "answer": 4, "level": 1}) + "\n\n"
                    + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    rows = load_prompts(path, system_prompt="Be brief.")
    assert rows[0].messages == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "2+2?"}]
    assert rows[0].answer == "4" and rows[0].metadata == {"level": 1}
    assert rows[1].answer is None and rows[1].source.endswith("d.jsonl:3")


@pytest.mark.parametrize("line, problem", [
    ("{not json", "not valid JSON"),
    (json.dumps({"question": "x"}), "needs a non-empty string `prompt`"),
    (json.dumps({"messages": [{"role": "user"}]}), "`messages` must be"),
    (json.dumps([1, 2]), "must be an object"),
])
def test_malformed_row_names_file_and_line(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + line + "\n")
    with pytest.raises(ConfigError) as info:
        load_prompts(path)
    assert f"{path}:2" in str(info.value) and problem in str(info.value)


def test_the_first_bad_line_is_named_whatever_is_wrong_with_it(tmp_path):
    """A row without a prompt on line 2 comes before broken JSON on line 3: reading the whole
    file's JSON first used to name line 3."""
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([json.dumps({"prompt": "ok"}), json.dumps({"question": "x"}),
                               "{not json"]) + "\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}:2: needs a non-empty string `prompt`")):
        load_prompts(path)


def test_parquet_rows(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), path)
    assert [r.answer for r in load_prompts(path)] == ["1", "2"]


def test_missing_or_empty_or_unknown_format(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_prompts(tmp_path / "x.jsonl")
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        load_prompts(tmp_path / "e.jsonl")
    (tmp_path / "d.csv").write_text("a,b")
    with pytest.raises(ConfigError, match="unsupported dataset format"):
        load_prompts(tmp_path / "d.csv")


def test_sampler_is_reproducible_and_resumable(tmp_path):
    rows = load_prompts(write_arithmetic(tmp_path, train_size=10, eval_size=2)["train"])
    a = PromptSampler(rows, seed=3)
    first = [r.prompt_text for r in a.next_batch(7)]
    state = a.state_dict()
    rest = [r.prompt_text for r in a.next_batch(8)]  # crosses an epoch boundary
    b = PromptSampler(rows, seed=3)
    assert [r.prompt_text for r in b.next_batch(7)] == first
    c = PromptSampler(rows, seed=3)
    c.load_state_dict(state)
    assert [r.prompt_text for r in c.next_batch(8)] == rest
    assert sorted(first + rest[:3]) == sorted(r.prompt_text for r in rows)  # one full epoch


def test_arithmetic_answers_are_correct_and_eval_is_held_out(tmp_path):
    for row in arithmetic_rows(200, seed=1):
        work = row["solution"].split(" The answer")[0]
        last = work.rstrip(".").split(". ")[-1]
        lhs, rhs = last.split(" = ")
        assert eval(lhs) == int(rhs) == int(row["answer"])  # noqa: S307 - our own generated text
    paths = write_arithmetic(tmp_path, train_size=300, eval_size=50)
    train = {json.loads(line)["prompt"] for line in open(paths["train"])}
    held_out = {json.loads(line)["prompt"] for line in open(paths["eval"])}
    assert len(train) > 0 and not train & held_out


def test_direct_frac_mixes_sft_targets():
    rows = list(arithmetic_rows(400, seed=0, direct_frac=0.5))
    direct = sum(r["response"].startswith("The answer") for r in rows)
    assert 150 < direct < 250


def test_collate_aligns_masks_and_logprobs():
    trajectories = [Trajectory([1, 2, 3], [4, 5], [-0.5, -0.25], "stop", 0, reward=1.0),
                    Trajectory([1, 2], [6, 7, 8], [-1.0, -2.0, -3.0], "length", 1)]
    batch, metadata = collate(trajectories, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5], [1, 2, 6, 7, 8]]
    assert batch["response_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]]
    assert batch["behaviour_logprobs"][0].tolist() == [0, 0, 0, -0.5, -0.25]
    assert batch["rewards"].tolist() == [1.0, 0.0] and metadata[1]["finish_reason"] == "length"
    micro = split_micro_batches(collate(trajectories[:1] + [Trajectory([1], [2], [0.0], "stop", 1)], 0)[0], 1)
    assert micro[1]["input_ids"].shape == (1, 2)  # trimmed to its own length
    with pytest.raises(ValueError):
        Trajectory([1], [2, 3], [0.0], "stop", 0)
    assert torch.equal(micro[0]["input_ids"], torch.tensor([[1, 2, 3, 4, 5]]))


def test_code_task_demonstrations_pass_their_asserts_unless_sloppy(tmp_path):
    """The `code` task's rows scored by the real code reward in the sandbox: a right
    demonstration passes its three asserts; a sloppy one (it adds where the prompt says minus
    or times) fails; eval prompts never appear in train."""
    from reroll.data.tasks import code_rows, write_code
    from reroll.rewards.code import CodeRewardFn

    reward = CodeRewardFn(time_limit_s=5)
    rows = list(code_rows(12, seed=3, sloppy_frac=0.5))
    sloppy = [" plus " not in r["prompt"] and "return x + " in r["response"] for r in rows]
    assert any(sloppy) and not all(sloppy)
    scores = asyncio.run(_score_all(reward, rows))
    assert scores == [0.0 if s else 1.0 for s in sloppy]
    assert json.loads(rows[0]["answer"])["asserts"][0].startswith("assert ")
    paths = write_code(tmp_path, train_size=300, eval_size=20, seed=1, sloppy_frac=0.5)
    train = {json.loads(line)["prompt"] for line in paths["train"].open()}
    held_out = [json.loads(line)["prompt"] for line in paths["eval"].open()]
    assert len(held_out) == len(set(held_out)) == 20 and not train & set(held_out)


async def _score_all(reward, rows):
    from reroll.rewards.base import RewardSample
    results = await asyncio.gather(*(reward(RewardSample(prompt=r["prompt"], response=r["response"],
                                                         answer=r["answer"], metadata={}))
                                     for r in rows))
    return [r.score for r in results]
