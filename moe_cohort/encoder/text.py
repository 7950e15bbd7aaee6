"""What text represents a request: the one place that decides it, for planning and training alike.

- a string is its own text;
- chat messages (OpenAI `messages`) are flattened newest first: the text parts of each message's
  content, messages joined by a blank line. Newest first because the encoder truncates at its
  maximum sequence length, and the latest user turn says most about what the model will generate;
  a long system prompt must not crowd it out. Roles are left out: they are the same words in every
  request and would only pull all embeddings together;
- a completion `prompt` is a string or a list of strings (joined by newlines);
- a dict is read through its `messages`, `prompt` or `text` field, in that order.

Anything else (token-id prompts, content without text, empty text) raises RequestTextError.
"""

from __future__ import annotations

from typing import Any


class RequestTextError(ValueError):
    """A request carries no text the encoder can use; the message says why."""


def request_text(request: Any) -> str:
    """The text that represents `request` (a string, a message list or a request body dict)."""
    if isinstance(request, str):
        text = request
    elif isinstance(request, list) and (not request or isinstance(request[0], dict)):
        text = messages_text(request)
    elif isinstance(request, dict):
        text = _body_text(request)
    else:
        raise RequestTextError(f"expected a string, a list of chat messages or a request body, got {type(request).__name__}")
    if not text.strip():
        raise RequestTextError("the request has no text to embed (empty prompt or messages)")
    return text


def messages_text(messages: list) -> str:
    """Chat messages flattened newest first, blank line between messages."""
    parts = []
    for i, message in enumerate(reversed(messages)):
        if not isinstance(message, dict) or "content" not in message:
            raise RequestTextError(f"message {len(messages) - 1 - i} must be an object with a 'content' field")
        text = content_text(message["content"])
        if text:
            parts.append(text)
    return "\n\n".join(parts)


def content_text(content: Any) -> str:
    """A message's content: a string, None (tool calls) or a list of parts whose text parts count."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text", "") if isinstance(p, dict) else p for p in content]
        if not all(isinstance(t, str) for t in texts):
            raise RequestTextError("content parts must be strings or objects with a string 'text'")
        return "\n".join(t for t in texts if t)
    raise RequestTextError(f"message content must be a string or a list of parts, got {type(content).__name__}")


def _body_text(body: dict) -> str:
    if "messages" in body:
        if not isinstance(body["messages"], list):
            raise RequestTextError("'messages' must be a list of chat messages")
        return messages_text(body["messages"])
    if "prompt" in body:
        return _prompt_text(body["prompt"])
    if "text" in body:
        if not isinstance(body["text"], str):
            raise RequestTextError("'text' must be a string")
        return body["text"]
    raise RequestTextError("the request body has neither 'messages' nor 'prompt' (nor 'text')")


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return "\n".join(prompt)
    raise RequestTextError("'prompt' must be a string or a list of strings (token-id prompts cannot be embedded)")
