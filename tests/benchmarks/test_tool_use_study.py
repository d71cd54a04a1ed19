"""The tool-use study's set is well formed and its scoring reads calls as the docstring says."""

from __future__ import annotations

import json

import jsonschema

from benchmarks.studies.tool_use import calls_in_text, canonical, load_set, score

WEATHER = canonical("get_weather", {"city": "Paris", "unit": "celsius"})


def test_the_set_covers_every_kind_and_its_expected_calls_fit_the_offered_tools():
    items = load_set()
    assert len(items) >= 30
    assert len({i["id"] for i in items}) == len(items)
    kinds = {i["kind"] for i in items}
    assert kinds == {"single", "choose", "parallel", "no-tool", "multi-turn", "required", "named"}
    assert any(len(i["expected"]) >= 2 for i in items if i["kind"] == "parallel")
    assert any(m["role"] == "tool" for i in items for m in i["messages"])
    for item in items:
        tools = {t["function"]["name"]: t["function"]["parameters"] for t in item["tools"]}
        for call in item["expected"]:
            jsonschema.validate(call["arguments"], tools[call["name"]])
        if isinstance(item["tool_choice"], dict):
            assert [c["name"] for c in item["expected"]] == [item["tool_choice"]["function"]["name"]]
        if item["tool_choice"] in ("required",) or isinstance(item["tool_choice"], dict):
            assert item["expected"], item["id"]


def test_calls_are_found_in_tags_fences_lists_and_python_syntax():
    tagged = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    fenced = 'Sure:\n```json\n{"name": "get_weather", "parameters": {"unit": "celsius", "city": "Paris"}}\n```'
    args = json.dumps({"city": "Paris", "unit": "celsius"})
    listed = json.dumps([{"function": {"name": "get_weather", "arguments": args}}])
    python = 'I will call get_weather(city="Paris", unit="celsius") now.'
    for text in (tagged, fenced, listed, python):
        assert calls_in_text(text) == [WEATHER], text
    assert calls_in_text("Paris is in France; len(x) is 3 and {\"a\": 1} is not a call.") == []


def _item(expected, tools=("get_weather", "get_time")):
    return {"expected": expected, "tools": [{"function": {"name": n}} for n in tools]}


def _answer(content=None, calls=(), status=200):
    return {"status": status, "content": content,
            "tool_calls": [{"name": n, "arguments": json.dumps(a)} for n, a in calls]}


def test_scoring_right_undeclared_and_what_the_text_named():
    expected = [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]
    call = ("get_weather", {"unit": "celsius", "city": "Paris"})
    assert score(_item(expected), _answer(calls=[call])) == {
        "right": True, "non_2xx": False, "undeclared": 0, "text_names_right": True}
    # the call left in the content: the model named it, the server did not read it
    missed = score(_item(expected), _answer(content=json.dumps({"name": call[0], "arguments": call[1]})))
    assert (missed["right"], missed["text_names_right"]) == (False, True)
    # an extra call, or arguments that differ, are wrong
    assert not score(_item(expected), _answer(calls=[call, ("get_time", {"timezone": "UTC"})]))["right"]
    assert not score(_item(expected), _answer(calls=[("get_weather", {"city": "paris", "unit": "celsius"})]))["right"]
    # an answer with no call is right for an item expecting none, unless the text names one
    assert score(_item([]), _answer(content="Paris.")) == {
        "right": True, "non_2xx": False, "undeclared": 0, "text_names_right": True}
    assert score(_item([]), _answer(content='{"name": "book_table", "arguments": {}}'))["text_names_right"] is False
    assert score(_item([]), _answer(calls=[("book_table", {})]))["undeclared"] == 1
    # where the answer carries the model's raw tokens, those say what the text named
    raw = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    assert score(_item(expected), {**_answer(), "raw": raw})["text_names_right"] is True
    assert score(_item(expected), {**_answer(calls=[call]), "raw": "Paris"})["text_names_right"] is False
    assert score(_item(expected), _answer(status=400)) == {
        "right": False, "non_2xx": True, "undeclared": 0, "text_names_right": False}
