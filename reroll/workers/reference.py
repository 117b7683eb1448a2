"""ReferenceWorker: the frozen reference policy; logprobs of a batch shard."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from reroll.models.loading import load_model
from reroll.models.logprobs import batched_logprobs


class ReferenceWorker:
    def __init__(self, *, rank: int, world_size: int, model_path: str, dtype: str,
                 micro_batch_size: int, attn_implementation: str = "auto", device: str = "cpu",
                 autocast_bf16: bool = False):
        self.model = load_model(model_path, dtype, attn_implementation).eval().to(device)
        self.micro_batch_size = micro_batch_size
        self.autocast = torch.autocast(device_type=torch.device(device).type,
                                       dtype=torch.bfloat16, enabled=autocast_bf16)

    def logprobs(self, shard: TensorDict, temperature: float = 1.0) -> torch.Tensor:
        with self.autocast:
            return batched_logprobs(self.model, shard["input_ids"], shard["attention_mask"],
                                    self.micro_batch_size, temperature, shard["response_mask"])
