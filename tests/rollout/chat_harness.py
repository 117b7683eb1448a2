"""A cheap, unmodified `openai` SDK harness for the gateway's async tests: two chat calls (the
second resends the first reply and a follow-up), and a reward the harness computes itself. A
task with `"crash": true` raises after its first call, as a broken harness would."""

from __future__ import annotations

import openai

TASKS = [{"prompt": f"Task {k}: say something."} for k in range(6)] + [
    {"prompt": "Task 6: this harness breaks.", "crash": True}]


def chat(task: dict, base_url: str, api_key: str) -> float:
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages)
        if task.get("crash"):
            raise RuntimeError("the harness broke")
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "And then?"}]
    return float(len(reply.choices[0].message.content or "") % 2)
