"""`python scripts/bench_structured.py [MODEL] --schemas one-schema|distinct-schemas`: requests
under JSON schemas (one shared, or each its own: every compile is timed, none cached from a run
before; the vocabulary's one-time preparation is done by a warm-up request) against the same
requests unconstrained with the same output lengths, in one engine."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from parashift.bench.options import NumPrompts, Sampling, SaveJson, sampling_fields
from parashift.cli_options import engine_options, fail, setup_logging

if TYPE_CHECKING:
    from parashift.engine.args import EngineArgs

SCHEMA_KINDS = ("one-schema", "distinct-schemas")
PROMPT = "Describe person number {i} as a JSON object."


def schema(i: int) -> dict[str, Any]:
    """A person record; `i` names its fields apart (a distinct compile for each i)."""
    return {"type": "object", "properties": {
        f"name_{i}": {"type": "string", "maxLength": 24},
        f"age_{i}": {"type": "integer", "minimum": 0, "maximum": 120},
        f"city_{i}": {"type": "string", "maxLength": 24},
        f"skills_{i}": {"type": "array", "items": {"type": "string", "maxLength": 16},
                        "maxItems": 4}},
        "required": [f"name_{i}", f"age_{i}", f"city_{i}", f"skills_{i}"],
        "additionalProperties": False}


def run_structured(llm: Any, kind: str, num_prompts: int, sampling: dict, repeat: int
                   ) -> dict[str, Any]:
    """Per repeat: the constrained run (compile cache emptied first), then the unconstrained
    one with each request's output length; rates from the medians."""
    from parashift import SamplingParams, StructuredOutputsParams

    prompts = [[{"role": "user", "content": PROMPT.format(i=i)}] for i in range(num_prompts)]
    fields = {"temperature": 0.8, "seed": 0, **sampling}
    constrained_s, free_s, hits = [], [], []
    lengths: list[int] = []
    warm = StructuredOutputsParams(json={"type": "integer"})
    llm.chat(prompts[:1], SamplingParams(max_tokens=4, structured_outputs=warm), use_tqdm=False)
    for _ in range(repeat):
        llm.engine.structured_grammars().clear()  # every compile of the run is timed
        params = [SamplingParams(max_tokens=512, **fields, structured_outputs=(
            StructuredOutputsParams(json=schema(0 if kind == "one-schema" else i))))
                  for i in range(num_prompts)]
        start = time.perf_counter()
        outs = llm.chat(prompts, params, use_tqdm=False)
        constrained_s.append(time.perf_counter() - start)
        grammars = llm.engine.grammars
        hits.append(grammars.hit_rate if grammars else 0.0)
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        start = time.perf_counter()
        llm.chat(prompts, [SamplingParams(max_tokens=n, ignore_eos=True, **fields)
                           for n in lengths], use_tqdm=False)
        free_s.append(time.perf_counter() - start)
    tokens = sum(lengths)
    constrained = sorted(constrained_s)[len(constrained_s) // 2]
    free = sorted(free_s)[len(free_s) // 2]
    return {"kind": kind, "num_prompts": num_prompts, "output_tokens": tokens,
            "constrained_s": constrained_s, "unconstrained_s": free_s,
            "constrained_output_tok_s": tokens / constrained,
            "unconstrained_output_tok_s": tokens / free,
            "ratio": free / constrained, "compile_cache_hit_rate": hits}


def table(r: dict[str, Any]) -> str:
    return (f"{r['num_prompts']} requests under {r['kind']}, {r['output_tokens']} output tokens\n"
            f"{'':16}{'min s':>9}{'median s':>10}{'output tok/s':>14}\n"
            + "\n".join(f"{label:16}{min(r[key]):>9.3f}{sorted(r[key])[len(r[key]) // 2]:>10.3f}"
                        f"{r[rate]:>14.1f}"
                        for label, key, rate in (
                            ("constrained", "constrained_s", "constrained_output_tok_s"),
                            ("unconstrained", "unconstrained_s",
                             "unconstrained_output_tok_s")))
            + f"\nconstrained / unconstrained: {r['ratio']:.3f}x; compile cache hit rate "
            + ", ".join(f"{100 * h:.0f}%" for h in r["compile_cache_hit_rate"]))


@engine_options
def structured(
    engine_args: EngineArgs,
    schemas: Annotated[str, typer.Option(
        "--schemas", help="one-schema or distinct-schemas: --num-prompts chat requests under "
        "JSON schemas against the same unconstrained")] = "one-schema",
    num_prompts: NumPrompts = 64,
    repeat: Annotated[int, typer.Option(help="timed runs of each; rates from the medians")
                      ] = 1,
    sampling: Sampling = "",
    save_json: SaveJson = None,
) -> None:
    """Constrained (JSON schemas) against unconstrained throughput, same requests and lengths."""
    setup_logging()
    from parashift import LLM
    from parashift.bench import report

    if schemas not in SCHEMA_KINDS:
        fail(f"--schemas {schemas!r}: choose {' or '.join(SCHEMA_KINDS)}")
    if num_prompts < 1 or repeat < 1:
        fail("--num-prompts and --repeat must be >= 1")
    try:
        fields = sampling_fields(sampling)
        llm = LLM.from_engine_args(engine_args)  # one engine: dp > 1 is refused here
    except ValueError as e:
        fail(str(e))
    try:
        llm.chat([[{"role": "user", "content": "warm up"}]], use_tqdm=False)  # first step
        result = run_structured(llm, schemas, num_prompts, fields, repeat)
    finally:
        llm.shutdown()
    typer.echo(table(result))
    if save_json:
        report.save_json(save_json, "throughput-structured", {
            "model": llm.config.model.path, "dtype": str(llm.config.model.dtype),
            "structured": schemas, "num_prompts": num_prompts, "repeat": repeat,
            "sampling": fields}, result, [])


if __name__ == "__main__":
    typer.run(structured)
