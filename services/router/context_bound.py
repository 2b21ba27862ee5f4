"""A request's prompt (OpenAI's routes, and /v1/generate's prompt and token ids) measured against
`max_context_tokens` (the longest context of the models behind the router) from the body's raw bytes, before it is parsed: a prompt that certainly cannot fit is refused (400
`context_length_exceeded`, OpenAI's code) for the cost of a scan, not of parsing and validating each of its token
ids. Pure logic.

Why: a 16 MiB body whose `prompt` was 4 M token ids held one router worker's loop ~2.3 s (json.loads 0.5 s, the
body's validation 0.4 s, the engine request's dump and JSON 1.1 s) before the engine refused it, every other client
of that worker waiting. The scan is msgspec's: `prompt` and `messages` kept as raw JSON (skipped, not decoded), the
rest of the body not kept at all, then a count of the commas (30-90 ms for 16 MiB on the CPU machine).

Each bound is a lower bound of the prompt's tokens under the engines' byte tokenizer (libs/common/tokenizer.py: BOS,
then a token a UTF-8 byte), so a prompt that fits is never refused here:
1. a string of r raw JSON bytes, its quotes included, decodes to at least (r - 2) / 6 UTF-8 bytes (`\\u0041`, six
   bytes, is the longest spelling of one);
2. an array of c commas holds c + 1 token ids, if it holds ids (or one array of them: a one-prompt batch); if it
   holds strings, each comma is a separator or a byte of one of them, so the one string of a valid one-prompt
   list holds at least c bytes: c + 1 tokens;
3. `messages`: each renders to at least 10 tokens (`<|user|>\\n`, its content, `\\n`), and the whole to 14 more
   (`<|assistant|>\\n`): openai_protocol.py `render_chat`.
A body this cannot read (not JSON, not an object, a field of another type) passes: its parser refuses it as before.
What passes is parsed, and its exact count checked before anything is sent (openai_protocol.py `prompt_tokens`).
"""

from __future__ import annotations

import msgspec

from services.router.openai_protocol import too_long

MESSAGE_MIN_TOKENS = 10
CHAT_TAIL_TOKENS = 14
_NULL = msgspec.Raw(b"null")


class _Peek(msgspec.Struct):
    prompt: msgspec.Raw = _NULL
    tokens: msgspec.Raw = _NULL  # /v1/generate's token ids, appended after its prompt's
    messages: list[msgspec.Raw] | None = None


_decoder = msgspec.json.Decoder(_Peek)


def prompt_lower_bound(raw: bytes) -> int:
    """At least this many tokens in the prompt `raw` (its JSON: a string or an array). Pure."""
    if raw.startswith(b'"'):
        return (len(raw) - 2 + 5) // 6 + 1
    if raw.startswith(b"["):
        return raw.count(b",") + (0 if raw[1:].lstrip().startswith(b"]") else 1)
    return 0


def refuse_early(body: bytes, max_context: int) -> None:
    """Raises the 400 of a body whose prompt (completions) or messages (chat) hold more than `max_context`
    tokens for certain; returns otherwise (it fits, or this cannot tell: the full parse decides)."""
    try:
        peek = _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):  # nested too deeply: json.loads says so
        return
    least = prompt_lower_bound(bytes(peek.prompt)) + prompt_lower_bound(bytes(peek.tokens))
    if least > max_context:
        raise too_long(max_context, least, "prompt" if peek.tokens == _NULL else "tokens", exact=False)
    if peek.messages is not None:
        least = MESSAGE_MIN_TOKENS * len(peek.messages) + CHAT_TAIL_TOKENS
        if least > max_context:
            raise too_long(max_context, least, "messages", exact=False)
