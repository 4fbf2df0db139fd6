"""The simulated model: what it writes for a request (greedy, deterministic).

Output: words of OUTPUT_WORDS in order, one token each, joined by single spaces. A known answer
(answers.py) ends with finish_reason "stop" ("tool_calls" for a tool call, as vLLM says for auto
and required tool choice). Otherwise exactly max_completion_tokens / max_tokens tokens, finish
"length"; with neither given, 64 tokens and "stop" (the model's own EOS). min_tokens pads an
answer with words; ignore_eos pads it to the limit (finish "length"). Thinking
(chat_template_kwargs thinking / enable_thinking, off by default) puts THINK_TOKENS reasoning
tokens first, streamed as `reasoning` (vLLM today) and `reasoning_content` (older vLLM,
SGLang); usage.completion_tokens counts them and completion_tokens_details.reasoning_tokens
names them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from .answers import arithmetic_answer, needle_answer, tool_arguments, tool_named
from .prompt import BadRequest, Prompt, flag
from .tokenizer import OUTPUT_WORDS, THINK_WORDS, tokenize

THINK_TOKENS = 16
NATURAL_TOKENS = 64  # reply length when the request sets no limit (the model's own EOS)


@dataclass
class Piece:
    """One output token: its kind (reasoning, content, tool_name, tool_args) and its text."""

    kind: str
    text: str


@dataclass
class Reply:
    """What the simulated model writes for a request."""

    pieces: list[Piece]
    finish_reason: str
    tool_name: str | None = None
    tool_id: str | None = None

    @property
    def reasoning_tokens(self) -> int:
        return sum(p.kind == "reasoning" for p in self.pieces)


def words_from(source: tuple[str, ...], n: int, kind: str) -> list[Piece]:
    """n tokens of a fixed word list, space-separated, as pieces of one kind."""
    return [Piece(kind, ("" if i == 0 else " ") + source[i % len(source)]) for i in range(n)]


def plan_reply(body: dict, prompt: Prompt, max_model_len: int) -> Reply:
    """The reply's tokens and finish reason: the whole simulated model, greedy."""
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    room = max_model_len - prompt.tokens
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise BadRequest(f"max_tokens must be at least 1, got {limit}.")
    if limit is not None and limit > room:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you"
            f" requested {limit} output tokens and your prompt contains at least"
            f" {prompt.tokens} input tokens, for a total of at least {prompt.tokens + limit}"
            " tokens. Please reduce the length of the input prompt or the number of requested"
            " output tokens."
        )
    min_tokens = int(body.get("min_tokens") or 0)
    ignore_eos = flag(body.get("ignore_eos"))
    kwargs = body.get("chat_template_kwargs") or {}
    thinking = flag(kwargs.get("thinking")) or flag(kwargs.get("enable_thinking"))

    pieces = words_from(THINK_WORDS, THINK_TOKENS, "reasoning") if thinking else []
    tools = body.get("tools") or []
    function = tool_named(tools, body.get("tool_choice", "auto"), prompt.last_user)
    if function:
        args = tokenize(tool_arguments(function, prompt.last_user))
        pieces += [Piece("tool_name", function["name"])]
        pieces += [Piece("tool_args", ("" if i == 0 else " ") + w) for i, w in enumerate(args)]
        named = isinstance(body.get("tool_choice"), dict)
        reply = Reply(pieces, "stop" if named else "tool_calls", function["name"])
        reply.tool_id = f"chatcmpl-tool-{uuid.uuid4().hex}"
        if limit is not None and len(pieces) > limit:
            return Reply(pieces[:limit], "length", reply.tool_name, reply.tool_id)
        return reply

    answer = needle_answer(prompt.texts, prompt.last_user) or arithmetic_answer(prompt.last_user)
    if answer is None:
        n = limit if limit is not None else room if ignore_eos else max(NATURAL_TOKENS, min_tokens)
        n = max(n - len(pieces), 0)
        pieces += words_from(OUTPUT_WORDS, n, "content")
        finish = "stop" if limit is None and not ignore_eos else "length"
        return Reply(pieces[: limit or len(pieces)], finish)
    pieces += words_from(tuple(tokenize(answer)), len(tokenize(answer)), "content")
    pad_to = (limit if limit is not None else room) if ignore_eos else min_tokens
    if len(pieces) < pad_to:
        pad = words_from(OUTPUT_WORDS, pad_to - len(pieces), "content")
        pieces += [Piece(p.kind, " " + p.text.lstrip()) for p in pad]
    if limit is not None and len(pieces) >= limit and (ignore_eos or len(pieces) > limit):
        return Reply(pieces[:limit], "length")
    return Reply(pieces, "stop")
