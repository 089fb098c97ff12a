"""Workloads: random lengths, JSONL rows, ShareGPT conversations, and clear errors."""

from __future__ import annotations

import json

import pytest

from parashift.bench.datasets import load_dataset, parse_range, random_requests


class WordTokenizer:
    def encode(self, text):
        return [len(word) for word in text.split()]


def test_parse_range():
    assert parse_range("128", "--input-len-range") == (128, 128)
    assert parse_range("32:256", "--input-len-range") == (32, 256)
    for bad in ("256:32", "0:4", "a:b", "1:2:3", ""):
        with pytest.raises(ValueError, match="--input-len-range"):
            parse_range(bad, "--input-len-range")


def test_random_requests_respect_the_ranges_and_the_seed():
    reqs = random_requests(200, (8, 16), (4, 4), 32000, seed=3)
    assert all(8 <= r.prompt_len <= 16 and len(r.prompt) == r.prompt_len for r in reqs)
    assert all(r.output_len == 4 and all(100 <= t < 31900 for t in r.prompt) for r in reqs)
    assert reqs == random_requests(200, (8, 16), (4, 4), 32000, seed=3)
    assert reqs != random_requests(200, (8, 16), (4, 4), 32000, seed=4)


def test_jsonl_rows_of_every_kind(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "hello big world", "output_len": 5},
        {"prompt": [1, 2, 3, 4], "output_len": 2},
        {"prompt_len": 7, "output_len": 3}]) + "\n\n")
    a, b, c = load_dataset(str(path), 10, WordTokenizer(), 32000, 0)
    assert (a.prompt, a.prompt_len, a.output_len) == ("hello big world", 3, 5)
    assert (b.prompt, b.prompt_len, b.output_len) == ([1, 2, 3, 4], 4, 2)
    assert c.prompt_len == 7 and len(c.prompt) == 7 and c.output_len == 3
    assert len(load_dataset(str(path), 2, WordTokenizer(), 32000, 0)) == 2
    assert load_dataset(str(path), 10, WordTokenizer(), 32000, 0, output_len=9)[0].output_len == 9


def test_sharegpt_json_list(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "what is two plus two"},
                           {"from": "gpt", "value": "four it is"}]},
        {"conversations": [{"from": "human", "value": "alone"}]},  # no reply: skipped
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]))
    reqs = load_dataset(str(path), 10, WordTokenizer(), 32000, 0)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in reqs] == [
        ("what is two plus two", 5, 3), ("hi", 1, 1)]


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "x", "output_len": 2}\n{broken\n', r"line 2 is not JSON"),
    ('{"prompt": "x"}\n', "needs an integer output_len"),
    ('{"output_len": 3}\n', "needs a prompt, or an integer prompt_len"),
    ('{"prompt": 5, "output_len": 3}\n', "prompt must be text or a list of token ids"),
    ('[1, 2]', "expected a JSON object"),
    ('[{"conversations": [', "not valid JSON"),
])
def test_bad_datasets_say_where(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_dataset(str(path), 10, WordTokenizer(), 32000, 0)


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="--dataset .*: no such file"):
        load_dataset(str(tmp_path / "nope.jsonl"), 1, WordTokenizer(), 32000, 0)
