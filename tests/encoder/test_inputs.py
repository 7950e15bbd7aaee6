import json

import pytest

from moe_cohort.encoder.inputs import InputError, parse_line, parse_lines


def batch_line(cid, content):
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "messages": [{"role": "user", "content": content}]}})


def test_detects_both_kinds():
    assert parse_line(batch_line("a", "hi"), 1).text == "hi"
    comp = json.dumps({"custom_id": "c", "body": {"model": "m", "prompt": "go on"}})
    assert parse_line(comp, 2).text == "go on"
    plain = parse_line('{"id": 7, "text": "plain"}', 3)
    assert (plain.id, plain.text, plain.line) == (7, "plain", 3)
    assert parse_line(batch_line("u", "é").encode("utf-8"), 4).text == "é"
    assert parse_line(b"\xef\xbb\xbf" + b'{"id": "b", "text": "bom"}', 1).text == "bom"


@pytest.mark.parametrize("raw, match", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"custom_id": "x"}', "body"),
    ('{"id": "x"}', "OpenAI Batch line"),
    ('{"id": "x", "text": 5}', "string"),
    ('{"id": true, "text": "t"}', "id must be"),
    ('{"custom_id": "x", "body": {"prompt": [1, 2]}}', "token-id"),
    (b'{"id": "x", "text": "\xff"}', "UTF-8"),
])
def test_bad_lines_name_their_line(raw, match):
    with pytest.raises(InputError, match=match) as info:
        parse_line(raw, 12)
    assert info.value.line == 12 and str(info.value).startswith("line 12:")


def test_parse_lines_numbers_skips_and_rejects():
    lines = [batch_line("a", "one"), "", "oops", batch_line("b", "two"), batch_line("a", "dup")]
    with pytest.raises(InputError, match="line 3"):
        list(parse_lines(lines))
    out = list(parse_lines(lines, skip_invalid=True))
    good = [o for o in out if not isinstance(o, InputError)]
    bad = [o for o in out if isinstance(o, InputError)]
    assert [(g.id, g.line) for g in good] == [("a", 1), ("b", 4)]
    assert [(b.line, b.raw) for b in bad] == [(3, "oops"), (5, lines[4])]
    assert "duplicate id" in bad[1].reason and "line 1" in bad[1].reason
