"""An unmodified tool-calling harness on the `openai` SDK, and the tiny model taught to call
its tool, for the gateway's training test.

`solve` is what a user writes: `chat.completions.create` with `tools`, run the calls the model
makes, send `tool` messages back, stop at a reply without calls; the reward is 1 when the final
answer holds the sum. `tool_model` gives the tiny model the Qwen3-style chat template (which
renders `tools=`; SmolLM2's has no tool support) and fits it on the harness's own two calls of a
few tasks (the tool call, then the answer), so the tiny random model really calls the tool.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                     "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]

TASKS = [{"prompt": f"What is {a} + {b}?", "a": a, "b": b}
         for a, b in ((17, 25), (301, 44), (9, 990), (123, 456))]


def add(a: int, b: int) -> int:
    return a + b


def conversation(task: dict) -> list[dict]:
    return [{"role": "user", "content": task["prompt"]}]


def solve(task: dict, base_url: str, api_key: str, max_calls: int = 3) -> float:
    """The harness: an OpenAI tool-calling loop (synchronous client, as most scripts are)."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = conversation(task)
    for _ in range(max_calls):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                               tool_choice="auto")
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float(str(task["a"] + task["b"]) in (message.content or ""))
        for call in message.tool_calls:
            try:
                result = str(add(**json.loads(call.function.arguments)))
            except (TypeError, ValueError) as e:  # a malformed call: the error goes back
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0


def scripted_calls(renderer, task: dict) -> list[tuple[list[int], list[int]]]:
    """The harness's two calls of `task` done right, as (prompt ids, completion ids): the
    gateway's own rendering and splicing (`ChatRenderer`), so the fitted model sees exactly
    the prompts it will be served."""
    from reroll.rollout.gateway.chat import parse_reply

    tok = renderer.tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    call = json.dumps({"name": "add", "arguments": {"a": task["a"], "b": task["b"]}})
    first = renderer.encode(renderer.render(conversation(task), TOOLS, True))
    said = f"<tool_call>\n{call}\n</tool_call>"
    first_out = renderer.encode(said) + [eos]
    reply = {"role": "assistant"} | {k: v for k, v in parse_reply(said, TOOLS).__dict__.items()
                                     if k in ("content", "tool_calls")}
    result = {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"],
              "content": str(task["a"] + task["b"])}
    rest = renderer.continuation(conversation(task) + [reply], "<|im_end|>", [result], TOOLS)
    second = first + first_out + rest
    second_out = renderer.encode(f"The sum is {task['a'] + task['b']}.") + [eos]
    return [(first, first_out), (second, second_out)]


def tool_model(tiny_model: str, out: Path, steps: int = 300) -> Path:
    """The tiny model with the Qwen3-style chat template (which renders `tools=`), fitted on
    the scripted calls of TASKS (loss on the completions only) until it recites them."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reroll.models.qwen_tokenizer import QWEN3_STYLE_TEMPLATE
    from reroll.rollout.gateway.chat import ChatRenderer

    shutil.copytree(tiny_model, out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    renderer = ChatRenderer(tokenizer)
    rows = [pair for task in TASKS for pair in scripted_calls(renderer, task)]
    loss = fit_completions(model, tokenizer.pad_token_id, rows, steps, stop_below=0.02)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / "fit.json").write_text(json.dumps({"final_loss": loss}))
    return out


def fit_completions(model, pad_token_id: int, rows: list[tuple[list[int], list[int]]],
                    steps: int, stop_below: float) -> float:
    """Fit `model` to (prompt ids, completion ids) rows, the loss on the completions only, for
    at most `steps` Adam steps or until the loss is under `stop_below`; the last loss."""
    import torch

    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.tensor([p + c + [pad_token_id] * (width - len(p) - len(c)) for p, c in rows])
    mask = torch.arange(width)[None] < torch.tensor([[len(p) + len(c)] for p, c in rows])
    labels = torch.full_like(ids, -100)
    for i, (p, c) in enumerate(rows):
        labels[i, len(p):len(p) + len(c)] = torch.tensor(c)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask.long(), labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < stop_below:
            break
    return loss.item()
