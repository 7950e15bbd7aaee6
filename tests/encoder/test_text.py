import pytest

from moe_cohort.encoder.text import RequestTextError, request_text


def test_strings_and_plain_bodies():
    assert request_text("hello") == "hello"
    assert request_text({"text": "hi there"}) == "hi there"
    assert request_text({"prompt": "complete me"}) == "complete me"
    assert request_text({"prompt": ["a", "b"]}) == "a\nb"


def test_chat_messages_flatten_newest_first_without_roles():
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "user", "content": [{"type": "text", "text": "And 3+3?"}, {"type": "image_url", "image_url": {"url": "x"}}]},
    ]
    want = "And 3+3?\n\nWhat is 2+2?\n\nYou are terse."
    assert request_text({"messages": messages, "model": "m"}) == want
    assert request_text(messages) == want  # the same function decides for a bare message list


@pytest.mark.parametrize("bad, match", [
    ({"prompt": [1, 2, 3]}, "token-id"),
    ({"messages": "hi"}, "list"),
    ({"messages": [{"role": "user"}]}, "content"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [{"role": "user", "content": "  "}]}, "no text"),
    ({"model": "m"}, "neither"),
    ({"text": 3}, "string"),
    (42, "expected"),
    ("", "no text"),
])
def test_unusable_requests(bad, match):
    with pytest.raises(RequestTextError, match=match):
        request_text(bad)
