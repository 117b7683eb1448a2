"""A reward that splits a random model's responses into winners and losers (odd vs even length),
so GRPO groups carry signal and the weights move; imported by path from test configs."""


def odd_length(sample) -> float:
    return float(len(sample.response) % 2)
