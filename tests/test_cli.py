"""`parashift generate` as a user runs it: a real subprocess. Flags refused before any engine
starts are checked in process, through the same typer app (a subprocess spent its ~6 s on
imports)."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import cli_in_process

from parashift.cli_options import parse_size


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parashift.cli", *args], capture_output=True,
                          text=True, timeout=300)


def run_both(*commands: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """The commands at once: most of each is start-up, which overlaps well."""
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: run_cli(*args), commands))


def test_generate_streams_one_prompt_and_runs_pipeline_stages(tiny_llama):
    args = ("generate", tiny_llama, "--prompt", "hello", "--max-tokens", "6", "--ignore-eos",
            "--dtype", "float32", "--kv-cache-memory", "32MiB")
    pp1, pp2 = run_both(args, (*args, "--strategy", "pp2", "--pp-layer-partition", "1,1"))
    assert pp1.returncode == 0, pp1.stderr
    assert pp1.stdout.strip()
    assert "KV cache:" in pp1.stderr  # start-up logs the block count
    assert pp2.returncode == 0, pp2.stderr
    assert pp2.stdout == pp1.stdout and "2 workers ready" in pp2.stderr


def test_generate_runs_an_moe_model_with_experts_over_tp_ranks(tiny_model_factory):
    model = tiny_model_factory("mixtral")
    args = ("generate", model, "--prompt", "hello", "--max-tokens", "6", "--ignore-eos",
            "--dtype", "float32", "--kv-cache-memory", "32MiB")
    whole, split = run_both(args, (*args, "--strategy", "tp2xep"))
    assert split.returncode == 0, split.stderr
    assert split.stdout == whole.stdout and "2 workers ready" in split.stderr


def test_generate_batch_prints_every_prompt(tiny_llama):
    result = run_cli("generate", tiny_llama, "-p", "a", "-p", "b", "--max-tokens", "3",
                     "--ignore-eos", "--chat", "--kv-cache-memory", "32MiB")
    assert result.returncode == 0, result.stderr
    assert "[0] 'a' (length)" in result.stdout and "[1] 'b' (length)" in result.stdout


@pytest.mark.parametrize("args,message", [
    (["--kv-cache-memory", "2XB"], "--kv-cache-memory"),
    (["--top-p", "2"], "top_p must be in (0, 1]"),
    (["--max-tokens", "0"], "max_tokens must be at least 1"),
    (["-pp", "2", "--pp-layer-partition", "1,2"],
     "--pp-layer-partition 1,2 sums to 3, the model has 2 layers"),
    (["-pp", "2", "--pp-layer-partition", "a,b"], "--pp-layer-partition 'a,b': give the layers"),
    (["--strategy", "pp3"], "pp3 needs at least 3 layers, the model has 2"),
])
def test_bad_flags_are_named(tiny_llama, args, message):
    result = cli_in_process("generate", tiny_llama, "--prompt", "x", *args)
    assert result.exit_code == 2
    assert message in result.stderr


def test_missing_prompt():
    result = cli_in_process("generate")
    assert result.exit_code == 2 and "--prompt" in result.stderr


def test_parse_size():
    assert parse_size("2GiB", "--x") == 2 << 30
    assert parse_size("512MiB", "--x") == 512 << 20
    assert parse_size("1000", "--x") == 1000


def test_engine_options_become_one_engine_args():
    import typer
    from typer.testing import CliRunner

    from parashift.cli_options import engine_options
    from parashift.engine.args import EngineArgs

    seen = {}

    @engine_options
    def command(engine_args, repeat: int = 1) -> None:
        seen.update(engine_args=engine_args, repeat=repeat)

    app = typer.Typer()
    app.command()(command)
    result = CliRunner().invoke(app, ["my-model", "--repeat", "3", "-dp", "2", "--threads", "1",
                                      "--kv-cache-memory", "1GiB", "--no-enable-prefix-caching"])
    assert result.exit_code == 0, result.output
    assert seen["repeat"] == 3
    assert seen["engine_args"] == EngineArgs(model="my-model", data_parallel_size=2,
                                             num_threads=1, kv_cache_memory=2**30,
                                             enable_prefix_caching=False)


def test_every_engine_command_takes_every_engine_flag():
    from typer.main import get_command

    from parashift.cli import app

    root = get_command(app)
    bench = root.commands["bench"]
    commands = {"run": root.commands["run"], "generate": root.commands["generate"],
                "bench throughput": bench.commands["throughput"],
                "bench latency": bench.commands["latency"]}
    flags = {"--dtype", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
             "--block-size", "--kv-cache-memory", "--gpu-memory-utilization",
             "--enable-prefix-caching", "--threads", "--strategy", "-dp", "-tp", "-pp",
             "--enable-expert-parallel"}
    for name, command in commands.items():
        opts = {opt for param in command.params for opt in param.opts}
        assert flags <= opts, (name, flags - opts)
        assert command.params[0].name == "model", name  # MODEL stays the first argument
