"""Multi-domain config and data errors: each names the domain, the file and the line."""

import json

import pytest

from reroll.config.errors import ConfigError
from reroll.config.schema import RLConfig
from reroll.pipelines.domains import build_domain


def config(tiny_model, *domains, **data) -> RLConfig:
    return RLConfig(steps=1, model={"path": tiny_model},
                    data={"domains": list(domains), **data})


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_malformed_row_names_the_domain_file_and_line(tmp_path, tiny_model, tokenizer):
    path = write(tmp_path / "a.jsonl", [{"prompt": "1+1", "answer": "2"}, {"answer": "3"}])
    c = config(tiny_model, {"name": "math", "train": path, "reward": {"type": "math"}})
    with pytest.raises(ConfigError, match=rf"data.domains\[0\] \(math\): {path}:2: needs"):
        build_domain(c, tokenizer, 0, c.data.domains[0])


def test_an_unknown_rule_names_the_domain_file_and_line(tmp_path, tiny_model, tokenizer):
    path = write(tmp_path / "r.jsonl", [{"prompt": "hi", "constraints": ["lowercase"]},
                                        {"prompt": "yo", "constraints": ["lower_case"]}])
    c = config(tiny_model, {"name": "math", "train": path, "reward": {"type": "math"}},
               {"name": "ifeval", "train": path, "reward": {"type": "rules"}})
    with pytest.raises(ConfigError, match=rf"data.domains\[1\] \(ifeval\): {path}:2: unknown "
                                          r"check 'lower_case' \(did you mean lowercase"):
        build_domain(c, tokenizer, 1, c.data.domains[1])


def test_a_math_domain_without_answers_is_refused(tmp_path, tiny_model, tokenizer):
    path = write(tmp_path / "r.jsonl", [{"prompt": "hi"}])
    c = config(tiny_model, {"name": "m", "train": path, "eval": path})
    with pytest.raises(ConfigError, match=r"data.domains\[0\] \(m\).train: reward.type=math "
                                          r"needs an `answer`"):
        build_domain(c, tokenizer, 0, c.data.domains[0])


def test_an_unknown_reasoning_gym_task_lists_close_names(tiny_model, tokenizer):
    c = config(tiny_model, {"name": "g", "reasoning_gym": {"task": "leg_countin", "size": 2}})
    with pytest.raises(ConfigError, match=r"data.domains\[0\] \(g\).reasoning_gym.task: .*did "
                                          r"you mean leg_counting"):
        build_domain(c, tokenizer, 0, c.data.domains[0])


@pytest.mark.parametrize(("data", "message"), [
    ({"train": "x.jsonl", "domains": [{"name": "a", "train": "y.jsonl"}]}, "exclude each other"),
    ({"domains": []}, "data.domains is empty"),
    ({"domains": [{"name": "a", "train": "x"}, {"name": "a", "train": "y"}]}, "a repeated"),
    ({"domains": [{"name": "a"}]}, "exactly one of `train`"),
    ({"domains": [{"name": "a", "reasoning_gym": {"task": "t"}, "eval": "e.jsonl"}]},
     "generated"),
    ({"domains": [{"name": "a/b", "train": "x"}]}, "pattern"),
])
def test_config_errors(data, message):
    with pytest.raises(ValueError, match=message):
        RLConfig(steps=1, model={"path": "m"}, data=data)


def test_domains_refuse_tail_batching_but_take_async_training():
    domains = {"domains": [{"name": "a", "train": "x"}]}
    with pytest.raises(ValueError, match="data.domains cannot be combined with tail_batching"):
        RLConfig(steps=1, model={"path": "m"}, data=domains, tail_batching={"enabled": True})
    RLConfig(steps=1, model={"path": "m"}, data=domains, async_training={"enabled": True})
