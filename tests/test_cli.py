"""`parashift generate` as a user runs it: a real subprocess."""

from __future__ import annotations

import subprocess
import sys

import pytest

from parashift.cli_options import parse_size


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parashift.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_generate_streams_one_prompt(tiny_llama):
    result = run_cli("generate", tiny_llama, "--prompt", "hello", "--max-tokens", "6",
                     "--ignore-eos", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "KV cache:" in result.stderr  # start-up logs the block count


def test_generate_batch_prints_every_prompt(tiny_llama):
    result = run_cli("generate", tiny_llama, "-p", "a", "-p", "b", "--max-tokens", "3",
                     "--ignore-eos", "--chat")
    assert result.returncode == 0, result.stderr
    assert "[0] 'a' (length)" in result.stdout and "[1] 'b' (length)" in result.stdout


@pytest.mark.parametrize("args,message", [
    (["--kv-cache-memory", "2XB"], "--kv-cache-memory"),
    (["--top-p", "2"], "top_p must be in (0, 1]"),
    (["--max-tokens", "0"], "max_tokens must be at least 1"),
])
def test_bad_flags_are_named(tiny_llama, args, message):
    result = run_cli("generate", tiny_llama, "--prompt", "x", *args)
    assert result.returncode == 2
    assert message in result.stderr


def test_missing_prompt():
    result = run_cli("generate")
    assert result.returncode == 2 and "--prompt" in result.stderr


def test_parse_size():
    assert parse_size("2GiB", "--x") == 2 << 30
    assert parse_size("512MiB", "--x") == 512 << 20
    assert parse_size("1000", "--x") == 1000
