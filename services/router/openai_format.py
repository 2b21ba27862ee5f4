"""OpenAI's response bodies and server-sent events (pure logic: dicts and bytes, no I/O).

Shapes as OpenAI sends them. A stream is `data: <chunk>\\n\\n` events then `data: [DONE]\\n\\n`:
- completions: chunks `{"object": "text_completion", "choices": [{"text", "index", "logprobs", "finish_reason"}]}`;
- chat: a first chunk with `delta: {"role": "assistant", "content": ""}`, then `delta: {"content"}` chunks,
  then one with `delta: {}` and the finish_reason;
- with `stream_options.include_usage`, every chunk carries `"usage": null` and one last chunk before
  `[DONE]` has `"choices": []` and the usage;
- an error after the stream started is one `data: {"error": {...}}` event, and no `[DONE]`.
"""

from __future__ import annotations

import json
from typing import Any

from services.router.openai_protocol import Job

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def usage(job: Job, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": job.prompt_tokens + completion_tokens}


def _head(job: Job, created: int, obj: str) -> dict[str, Any]:
    return {"id": job.request_id, "object": obj, "created": created, "model": job.model}


def body(job: Job, created: int, text: str, finish_reason: str, completion_tokens: int) -> dict[str, Any]:
    """The whole answer of a request without `stream`."""
    if job.kind == "completion":
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        head = _head(job, created, "text_completion")
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                  "logprobs": None, "finish_reason": finish_reason}
        head = _head(job, created, "chat.completion")
    return {**head, "choices": [choice], "usage": usage(job, completion_tokens)}


def chunk(job: Job, created: int, text: str | None, finish_reason: str | None = None, *,
          first: bool = False) -> dict[str, Any]:
    """One streamed chunk: `text` (None: none, as in chat's last chunk), or chat's first chunk (the role)."""
    if job.kind == "completion":
        choice: dict[str, Any] = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        out = {**_head(job, created, "text_completion"), "choices": [choice]}
    else:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        out = {**_head(job, created, "chat.completion.chunk"), "choices": [choice]}
    if job.include_usage:
        out["usage"] = None
    return out


def usage_chunk(job: Job, created: int, completion_tokens: int) -> dict[str, Any]:
    obj = "text_completion" if job.kind == "completion" else "chat.completion.chunk"
    return {**_head(job, created, obj), "choices": [], "usage": usage(job, completion_tokens)}
