"""FSDP2's units on a VLM: each of the language model's decoder layers is its own unit (gathered
just in time), as on a causal LM; the vision tower stays in the root's unit, which every rank
gathers on every forward, text-only or not.

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
    from torch.distributed.fsdp import FSDPModule
    from reroll.models.loading import load_model
    from reroll.training.fsdp2 import init_process_group, shard_model

    init_process_group()
    model = shard_model(load_model(sys.argv[1]))
    print(json.dumps([name for name, m in model.named_modules() if isinstance(m, FSDPModule)]))
""")


def test_a_vlm_s_decoder_layers_are_sharded_one_by_one(tiny_vlm):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                        "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, tiny_vlm], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    units = json.loads(done.stdout.strip().splitlines()[-1])
    assert units == ["", "model.text_model.layers.0", "model.text_model.layers.1"], units
