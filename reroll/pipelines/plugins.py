"""A researcher's own advantage estimator or policy loss, named by import path in the config
(`algorithm.advantage: {name: custom, function: my_module:my_estimator}`, likewise
`algorithm.policy_loss`), resolved and checked once at start (`objective.build`): a path that
does not import, or a function whose signature does not take the documented arguments, is a
ConfigError naming the field. The contracts (docs/algorithms.md, "Your own estimator or loss"):

    estimator(batch, group_size, **kwargs) -> advantages [B, T]
    policy_loss(logprobs, old_logprobs, advantages, mask, *, agg, num_tokens, num_seqs, max_len,
                is_weights, **kwargs) -> (loss, metrics)

`batch` is the step's `reroll.data.batch.RLBatch`; `kwargs` are the section's `kwargs`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from reroll.config.errors import ConfigError
from reroll.rewards.custom import resolve

ESTIMATOR_SIGNATURE = "estimator(batch, group_size, **kwargs) -> advantages [B, T]"
LOSS_SIGNATURE = ("policy_loss(logprobs, old_logprobs, advantages, mask, *, agg, num_tokens, "
                  "num_seqs, max_len, is_weights, **kwargs) -> (loss, metrics)")


def _checked(section, field: str, signature: str, args: tuple, keywords: dict) -> Callable:
    """The function of `section.function`, if it can be called with `args` and `keywords`
    (and the section's `kwargs`); a ConfigError naming `field.function` otherwise."""
    where = f"{field}.function"
    fn = resolve(section.function, where)
    try:
        inspect.signature(fn).bind(*args, **keywords, **section.kwargs)
    except TypeError as e:
        raise ConfigError(f"{where} {section.function!r} does not fit {signature} "
                          f"(with {field}.kwargs {section.kwargs}): {e}") from None
    except ValueError:  # a builtin without a signature: it is called as it is
        pass
    return fn


def custom_estimator(section, field: str) -> Callable[..., tuple[Tensor, Tensor | None]]:
    """The user's estimator as the step calls an estimator: fn(batch, group_size, token_kl,
    kl_coef) -> (advantages, None). (A KL reward penalty is refused for it at load time.)"""
    fn = _checked(section, field, ESTIMATOR_SIGNATURE, (None, 1), {})
    kwargs, path = dict(section.kwargs), section.function

    def estimate(batch, group_size, kl, kl_coef):
        advantages = fn(batch, group_size, **kwargs)
        mask = batch["response_mask"]
        if not isinstance(advantages, Tensor) or advantages.shape != mask.shape:
            got = tuple(advantages.shape) if isinstance(advantages, Tensor) else \
                type(advantages).__name__
            raise ValueError(f"{field}.function {path!r} returned {got}; it must return the "
                             f"advantages as a tensor of the response mask's shape "
                             f"{tuple(mask.shape)}")
        return advantages.to(mask.dtype), None

    return estimate


def custom_policy_loss(section, field: str) -> Callable[..., tuple[Tensor, dict]]:
    """The user's loss as the step calls a policy loss: fn(logprobs, old_logprobs, advantages,
    mask, micro, is_weights, **agg) -> (loss, metrics)."""
    t = torch.zeros(1, 1)
    fn = _checked(section, field, LOSS_SIGNATURE, (t, t, t, t),
                  {"agg": "token_mean", "num_tokens": 1.0, "num_seqs": 1.0, "max_len": 1,
                   "is_weights": None})
    kwargs = dict(section.kwargs)

    def policy_loss(logprobs, old, advantages, mask, micro, is_weights, **agg):
        return fn(logprobs, old, advantages, mask, is_weights=is_weights, **agg, **kwargs)

    return policy_loss
