"""A model sharded by FSDP2 is scored in chunks from inside its own forward (its LM head's
weight is gathered only there): the same logprobs, entropies and gradients as the unsharded
model, on the padded and the packed paths, without the full-vocabulary logits.

One FSDP2 rank (gloo) in a child process, so this test's process group never meets another's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.unit

CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from reroll.models.loading import load_model
    from reroll.models.logprobs import forward_logprobs
    from reroll.models.lm_head import OutputHead, sharded_plain_head
    from reroll.training.fsdp2 import init_process_group, shard_model

    torch.manual_seed(0)
    init_process_group()
    plain, sharded = load_model(sys.argv[1]), shard_model(load_model(sys.argv[1]))
    head = sharded_plain_head(sharded)
    shapes = []
    head.register_forward_hook(lambda module, args, out: shapes.append(list(out.shape)))
    ids = torch.randint(3, 200, (4, 12))
    ids[1, :6] = ids[0, :6]  # rows 0 and 1 share a prompt: the packed path packs them
    attention = torch.ones(4, 12, dtype=torch.long)
    attention[2, -3:] = 0
    response = torch.zeros(4, 12)
    response[:, 6:] = 1
    response *= attention
    out = {"sharded_is_fsdp": OutputHead.of(sharded) is None and head is not None,
           "vocab": plain.config.vocab_size}
    for path, mask in (("padded", None), ("packed", response)):
        results = []
        for model in (plain, sharded):
            model.zero_grad(set_to_none=True)
            logprobs, entropy = forward_logprobs(model, ids, attention, temperature=0.7,
                                                 with_entropy=True, response_mask=mask)
            (logprobs.sum() + 0.1 * entropy.sum()).backward()
            grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                     for name, p in model.named_parameters()}
            results.append((logprobs.detach(), entropy.detach(), grads))
        (lp0, ent0, g0), (lp1, ent1, g1) = results
        out[path] = {"logprobs": float((lp0 - lp1).abs().max()),
                     "entropy": float((ent0 - ent1).abs().max()),
                     "grads": max(float((g0[n] - g1[n]).abs().max()) for n in g0),
                     "nonzero": int((lp1 != 0).sum())}
    out["head_output_shapes"] = shapes
    print(json.dumps(out))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_sharded_model_is_scored_in_chunks_inside_its_forward(tiny_model):
    env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                        "RANK": "0", "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, tiny_model], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["sharded_is_fsdp"]
    for path in ("padded", "packed"):
        assert out[path]["nonzero"] > 0
        assert out[path]["logprobs"] < 1e-5, (path, out[path])
        assert out[path]["entropy"] < 1e-5, (path, out[path])
        assert out[path]["grads"] < 1e-5, (path, out[path])
    # the head ran on the scored positions only ([N, vocab]), never on [B, T, vocab]
    assert out["head_output_shapes"] and all(len(shape) == 2 and shape[1] == out["vocab"]
                                             for shape in out["head_output_shapes"])
