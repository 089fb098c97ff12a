"""The `parashift` command line. Only this module reads argv."""

from __future__ import annotations

import dataclasses
import secrets
import sys
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from parashift import env
from parashift.bench.cli import bench_app
from parashift.cli_options import engine_options, fail, parse_size, setup_logging
from parashift.defaults import (
    DEFAULT_DP_LOAD_SCORE,
    DEFAULT_ROUTING,
    DEFAULT_ROUTING_BALANCE_THRESHOLD,
    DEFAULT_ROUTING_BALANCE_THRESHOLD_TOKENS,
    DEFAULT_ROUTING_MIN_MATCH,
    served_max_waiting,
)
from parashift.plan.cli import Objective, plan
from parashift.wire.cluster_auth import read_secret_file

if TYPE_CHECKING:
    from parashift.engine.args import EngineArgs

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="parashift: LLM inference whose parallel layout is a plugin.")
app.add_typer(bench_app, name="bench")
app.command(name="plan")(plan)


@app.callback()
def _root() -> None:
    """Subcommands: run (OpenAI-compatible server), generate (offline), bench (measure),
    plan (dry-run a topology)."""


def resolve_auto_strategy(engine_args: EngineArgs, objective: str,
                          one_engine: bool = False) -> EngineArgs:
    """--strategy auto: the args with plan --auto's winner on this machine's devices in its
    place, printed with the runners-up (`one_engine`: among the layouts of a single engine)."""
    if engine_args.strategy != "auto":
        return engine_args
    from parashift.plan.this_machine import choose_strategy, describe

    try:
        spec, plans, _ = choose_strategy(engine_args, objective, one_engine)
    except ValueError as e:
        fail(str(e))
    typer.echo(describe(plans, spec), err=True)
    return dataclasses.replace(engine_args, strategy=str(spec))


@app.command()
@engine_options
def generate(
    engine_args: EngineArgs,
    prompt: Annotated[list[str] | None, typer.Option("--prompt", "-p",
                                                     help="repeat for a batch")] = None,
    chat: Annotated[bool, typer.Option(help="apply the model's chat template")] = False,
    system: Annotated[str | None, typer.Option(help="system message (with --chat)")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 128,
    temperature: float = 0.0,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k")] = -1,
    min_p: Annotated[float, typer.Option("--min-p")] = 0.0,
    n: int = 1,
    seed: Annotated[int | None, typer.Option(help="per-request sampling seed")] = None,
    stop: Annotated[list[str] | None, typer.Option("--stop")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos")] = False,
    objective: Objective = "throughput",
) -> None:
    """Offline generation: same engine, no HTTP. Streams the text of a single prompt."""
    setup_logging()
    if not prompt:
        fail("give at least one --prompt")
    engine_args = resolve_auto_strategy(engine_args, objective, one_engine=True)
    from parashift import LLM, SamplingParams

    try:
        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, min_p=min_p, seed=seed, stop=stop or [],
                                ignore_eos=ignore_eos)
        llm = LLM.from_engine_args(engine_args)
    except ValueError as e:
        fail(str(e))
    streaming = len(prompt) == 1 and n == 1

    def show(_: str, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        if chat:
            prefix = [{"role": "system", "content": system}] if system else []
            conversations = [prefix + [{"role": "user", "content": p}] for p in prompt]
            outputs = llm.chat(conversations, params, use_tqdm=not streaming,
                               on_output=show if streaming else None)
        else:
            outputs = llm.generate(prompt, params, use_tqdm=not streaming,
                                   on_output=show if streaming else None)
    except ValueError as e:
        fail(str(e))
    finally:
        llm.shutdown()  # the workers, now
    if streaming:
        sys.stdout.write("\n")
        return
    for i, out in enumerate(outputs):
        for sample in out.outputs:
            label = f"[{i}]" if n == 1 else f"[{i}.{sample.index}]"
            typer.secho(f"{label} {prompt[i]!r} ({sample.finish_reason})", bold=True)
            typer.echo(sample.text)


@app.command()
@engine_options
def run(
    engine_args: EngineArgs,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port; 0: one the kernel picks, named in the "
                                            "banner")] = 8000,
    api_server_count: Annotated[int, typer.Option("--api-server-count")] = 1,
    served_model_name: Annotated[str | None, typer.Option("--served-model-name")] = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", help="bearer key for every route but /health and /metrics (better: "
                          "PARASHIFT_API_KEY, which no other user can read)")] = None,
    max_body_size: Annotated[str, typer.Option(
        "--max-body-size", help="largest HTTP request body, e.g. 8MiB")] = "8MiB",
    enable_auto_tool_choice: Annotated[bool, typer.Option(
        "--enable-auto-tool-choice", help='tool_choice "auto" (the default with tools): '
        "the model's own tool calls, read by --tool-call-parser")] = False,
    tool_call_parser: Annotated[Literal["hermes", "llama3_json", "mistral"] | None,
                                typer.Option("--tool-call-parser", help="the model's tool call "
                                             "format (hermes: Qwen2.5/3, SmolLM2)")] = None,
    cluster_secret_file: Annotated[str | None, typer.Option(
        "--cluster-secret-file", help="multi-node: a file (mode 0600) holding the secret every "
        "node proves on its links (or PARASHIFT_CLUSTER_SECRET)")] = None,
    insecure_cluster: Annotated[bool, typer.Option(
        "--insecure-cluster", help="multi-node without a cluster secret (a private network "
        "only)")] = False,
    shutdown_timeout: Annotated[float, typer.Option("--shutdown-timeout",
                                                    help="seconds to drain on SIGTERM")] = 10.0,
    startup_timeout: Annotated[float, typer.Option(
        "--startup-timeout", help="seconds for every engine to load and report ready")] = 600.0,
    request_timeout: Annotated[float | None, typer.Option(
        "--request-timeout", help="seconds one request may take before it is aborted "
        "(504); default: no limit")] = None,
    max_request_output_units: Annotated[int | None, typer.Option(
        "--max-request-output-units", help="one request's n x (max_tokens + echoed prompt) x "
        "(1 + logprobs) at most (400 beyond); default: fits the model's context")] = None,
    stream_idle_timeout: Annotated[float, typer.Option(
        "--stream-idle-timeout", help="seconds a client may read nothing before it is dropped "
        "and its request aborted")] = 60.0,
    max_connections: Annotated[int, typer.Option(
        "--max-connections", help="open HTTP connections per API server")] = 1024,
    non_stream_timeout: Annotated[float, typer.Option(
        "--non-stream-timeout", help="seconds a non-streamed request may take (504), unless "
        "--request-timeout says less")] = 600.0,
    grammar_compile_timeout: Annotated[float, typer.Option(
        "--grammar-compile-timeout", help="seconds a structured-output constraint may compile "
        "before its compile is stopped and the request refused (400); at most 30, the "
        "engines' own limit")] = 30.0,
    max_tokenize_queue: Annotated[int, typer.Option(
        "--max-tokenize-queue", help="requests waiting for an API server's tokenizer thread "
        "(429 with Retry-After beyond)")] = 64,
    allowed_hosts: Annotated[list[str] | None, typer.Option(
        "--allowed-hosts", help="Host names served besides localhost, 127.0.0.1 and [::1] on "
        "a loopback bind (DNS rebinding); repeat or separate by commas")] = None,
    admin_api_key: Annotated[str | None, typer.Option(
        "--admin-api-key", help="the admin routes' own key (sleep, wake, reset; better: "
        "PARASHIFT_ADMIN_KEY); without it they are off")] = None,
    enable_admin_routes: Annotated[bool, typer.Option(
        "--enable-admin-routes", help="admin routes without their own key (a trusted network "
        "only)")] = False,
    seed: Annotated[int, typer.Option(help="the engines' random state (unseeded sampling)")] = 0,
    data_parallel_size_local: Annotated[int | None, typer.Option(
        "--data-parallel-size-local", "-dpl", help="dp ranks on this node (multi-node)")] = None,
    data_parallel_start_rank: Annotated[int, typer.Option(
        "--data-parallel-start-rank", "-dpr", help="first dp rank of a --headless node")] = 0,
    data_parallel_address: Annotated[str | None, typer.Option(
        "--data-parallel-address", "-dpa", help="the head node's address (multi-node)")] = None,
    data_parallel_rpc_port: Annotated[int, typer.Option(
        "--data-parallel-rpc-port", "-dpp", help="the head's handshake port")] = 29550,
    headless: Annotated[bool, typer.Option(
        help="run only engines, for the head at --data-parallel-address")] = False,
    restart_dead_engines: Annotated[bool, typer.Option(
        "--restart-dead-engines", help="start a dead engine rank again")] = False,
    heartbeat_timeout: Annotated[float, typer.Option(
        "--heartbeat-timeout", help="seconds of silence before a rank is declared dead")] = 5.0,
    data_parallel_size_max: Annotated[int | None, typer.Option(
        "--data-parallel-size-max", help="elastic data parallel: POST /scale (or parashift "
        "scale) may grow the deployment to this many ranks (on CPU each rank has its slice "
        "of the cores split this many ways, from the launch)")] = None,
    drain_timeout: Annotated[float, typer.Option(
        "--drain-timeout", help="seconds a scale-down lets its ranks' running requests "
        "finish; then unstreamed ones move and streams end with an error")] = 60.0,
    data_parallel_size_min: Annotated[int | None, typer.Option(
        "--data-parallel-size-min", help="start the autoscaler: between this many ranks and "
        "--data-parallel-size-max, by load")] = None,
    autoscale_up_tokens: Annotated[int, typer.Option(
        "--autoscale-up-tokens", help="one rank more when the prompt tokens waiting per "
        "rank average above this ...")] = 2048,
    autoscale_up_window: Annotated[float, typer.Option(
        "--autoscale-up-window", help="... over this many seconds")] = 10.0,
    autoscale_idle_window: Annotated[float, typer.Option(
        "--autoscale-idle-window", help="one rank less when, over this many seconds, one "
        "rank fewer would have held requests at most 75% of the time; one more when the "
        "ranks held requests 95% of it")] = 60.0,
    backend: Annotated[Literal["mp", "ray"], typer.Option(
        "--backend", "--data-parallel-backend",
        help="processes here, or actors on a Ray cluster")] = "mp",
    ray_address: Annotated[str | None, typer.Option(
        "--ray-address", help="Ray cluster (default: RAY_ADDRESS, else a local one)")] = None,
    ray_placement: Annotated[Literal["pack", "spread"], typer.Option(
        "--ray-placement", help="a rank's workers on one node, or spread")] = "pack",
    routing: Annotated[Literal["prefix", "load", "round-robin"], typer.Option(
        help="how an API server picks a dp rank: where the prompt's prefix is cached, the "
             "least loaded, or in turn")] = DEFAULT_ROUTING,
    routing_balance_threshold: Annotated[int | None, typer.Option(
        "--routing-balance-threshold", help="prefix routing follows the cache unless that "
        "rank's load score exceeds the least loaded's by more than this (default: "
        f"{DEFAULT_ROUTING_BALANCE_THRESHOLD_TOKENS} tokens, or "
        f"{DEFAULT_ROUTING_BALANCE_THRESHOLD} with --dp-load-score requests)")] = None,
    dp_load_score: Annotated[Literal["tokens", "requests"], typer.Option(
        "--dp-load-score", help="a dp rank's load: its work in tokens (prompt tokens still "
        "to compute, output tokens still allowed), or its requests (4 per waiting one, 1 per "
        "running)")] = DEFAULT_DP_LOAD_SCORE,
    routing_min_match: Annotated[float, typer.Option(
        "--routing-min-match", help="prefix routing follows the cache when at least this "
        "share of the prompt's full blocks is there")] = DEFAULT_ROUTING_MIN_MATCH,
    objective: Objective = "throughput",
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API until SIGINT/SIGTERM."""
    setup_logging()
    from parashift.runtime import child_processes

    # The cluster secret first: every process started from here on (the fork server's
    # children included) inherits it.
    if cluster_secret_file is not None:
        try:
            env.set_cluster_secret(read_secret_file(cluster_secret_file))
        except ValueError as e:
            fail(str(e))
    if backend == "ray" and env.cluster_secret() is None:
        env.set_cluster_secret(secrets.token_hex(32))  # a fresh one for this launch
    child_processes.start_early()  # its imports beside ours
    if api_server_count < 1:
        raise typer.BadParameter("must be >= 1", param_hint="--api-server-count")
    # A headless node resolves nothing: the head's config comes in its handshake, and only
    # the flags typed here are checked against it (runtime/headless.py).
    if not headless:
        engine_args = resolve_auto_strategy(engine_args, objective)
    waiting = engine_args.max_waiting_requests
    if waiting is None and not headless:  # served: a bounded queue, 429 beyond it
        waiting = served_max_waiting(engine_args.max_num_seqs)
    engine_args = dataclasses.replace(engine_args, seed=seed, max_waiting_requests=waiting)
    from parashift.processes import exit_now
    from parashift.runtime.launcher import run as run_server
    from parashift.runtime.node import ServeArgs

    if request_timeout is not None and request_timeout <= 0:
        raise typer.BadParameter("must be > 0", param_hint="--request-timeout")
    if data_parallel_size_max is not None and data_parallel_size_max < 1:
        raise typer.BadParameter("must be >= 1", param_hint="--data-parallel-size-max")
    autoscale = None
    if data_parallel_size_min is not None:
        if data_parallel_size_max is None:
            raise typer.BadParameter("the autoscaler needs --data-parallel-size-max too",
                                     param_hint="--data-parallel-size-min")
        from parashift.runtime.autoscaler import AutoscaleConfig

        try:
            autoscale = AutoscaleConfig(data_parallel_size_min, data_parallel_size_max,
                                        autoscale_up_tokens, autoscale_up_window,
                                        autoscale_idle_window)
        except ValueError as e:
            fail(str(e))
    if drain_timeout < 0:
        raise typer.BadParameter("must be >= 0", param_hint="--drain-timeout")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise typer.BadParameter("--enable-auto-tool-choice needs --tool-call-parser",
                                 param_hint="--tool-call-parser")
    max_body_bytes = parse_size(max_body_size, "--max-body-size")
    if max_body_bytes < 1024:
        raise typer.BadParameter("must be at least 1KiB", param_hint="--max-body-size")
    from parashift.serve.limits import ServeLimits
    from parashift.serve.prefix_router import RoutingConfig

    try:
        routing_config = RoutingConfig(routing, routing_balance_threshold, routing_min_match,
                                       dp_load_score)
        limits = ServeLimits(
            max_request_output_units=max_request_output_units,
            stream_idle_timeout=stream_idle_timeout, max_connections=max_connections,
            max_tokenize_queue=max_tokenize_queue,
            non_stream_timeout=non_stream_timeout, bind_host=host,
            allowed_hosts=tuple(h.strip() for hs in allowed_hosts or () for h in hs.split(",")
                                if h.strip()),
            admin_api_key=admin_api_key or env.admin_api_key(),
            enable_admin_routes=enable_admin_routes,
            grammar_compile_timeout=grammar_compile_timeout)
    except ValueError as e:
        fail(str(e))
    args = ServeArgs(
        engine_args, host=host, port=port, api_server_count=api_server_count,
        served_model_name=served_model_name, api_key=api_key or env.api_key(),
        max_body_bytes=max_body_bytes,
        shutdown_timeout=shutdown_timeout, startup_timeout=startup_timeout,
        request_timeout=request_timeout, log_level=env.log_level(),
        data_parallel_size_local=data_parallel_size_local,
        data_parallel_start_rank=data_parallel_start_rank,
        data_parallel_address=data_parallel_address,
        data_parallel_rpc_port=data_parallel_rpc_port, headless=headless,
        restart_dead_engines=restart_dead_engines, heartbeat_timeout=heartbeat_timeout,
        data_parallel_size_max=data_parallel_size_max, drain_timeout=drain_timeout,
        autoscale=autoscale,
        backend=backend, ray_address=ray_address, ray_placement=ray_placement,
        routing=routing_config, insecure_cluster=insecure_cluster,
        tool_call_parser=tool_call_parser if enable_auto_tool_choice else None, limits=limits)
    try:
        code = run_server(args)
    except ValueError as e:
        fail(str(e))
    exit_now(code)  # every child is stopped and reaped: no second spent unloading torch


@app.command()
def scale(
    size: Annotated[int, typer.Argument(help="the data-parallel size to serve with")],
    url: Annotated[str, typer.Option("--url", help="the server, e.g. http://127.0.0.1:8000")
                   ] = "http://127.0.0.1:8000",
    admin_api_key: Annotated[str | None, typer.Option(
        "--admin-api-key", help="the server's admin key (default: PARASHIFT_ADMIN_KEY)")
                             ] = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the answer")] = 900.0,
) -> None:
    """Scale a running server's data parallel (POST /scale); answers when SIZE ranks serve."""
    import json
    import urllib.error
    import urllib.request

    if not url.startswith(("http://", "https://")):
        fail(f"--url {url!r}: use http://host:port")
    key = admin_api_key or env.admin_api_key()
    request = urllib.request.Request(  # nosec B310 (http/https checked above)
        url.rstrip("/") + "/scale", data=json.dumps({"data_parallel_size": size}).encode(),
        headers={"Content-Type": "application/json",
                 **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:  # nosec B310
            body = json.loads(answer.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        fail(f"{e.code}: {message}")
    except (urllib.error.URLError, OSError) as e:
        fail(f"--url {url}: {getattr(e, 'reason', e)}")
    typer.echo(f"data parallel size {body['data_parallel_size']}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
