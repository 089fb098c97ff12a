"""`python scripts/bench_quantization.py`: weight-only int8 / int4 against the unquantized
model, on the same engine. Accuracy is measured on the reference's own greedy continuations of a
set of prompts, teacher-forced: at every position the quantized engine sees the reference's
prefix and is scored on whether its top token is the reference's (agreement) and on the
log-probability it gives the reference's token. A free-running greedy run adds how many
continuations stay identical. Speed: decode tokens/s at each batch size, and the weights' bytes."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from parashift.bench.options import SaveJson, Seed
from parashift.cli_options import engine_options, fail, parse_counts, setup_logging
from parashift.defaults import QUANTIZATIONS

if TYPE_CHECKING:
    from parashift.engine.args import EngineArgs

logger = logging.getLogger(__name__)

NUM_TOP = 20  # alternatives returned per position: the reference's token is looked up in them
PROMPTS = (  # varied registers; the model's chat template is applied when it has one
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "List three uses of a paperclip.",
    "How do I reverse a list in Python?",
    "Summarize the plot of Romeo and Juliet.",
    "What is 17 times 23?",
    "Give me a tip for learning a new language.",
    "Translate 'good morning' into Spanish and German.",
    "Why do cats purr?",
    "Describe the water cycle for a ten-year-old.",
    "What are the benefits of regular exercise?",
    "Write one sentence about the ocean at night.",
    "What does a compiler do?",
    "Name the planets of the solar system in order.",
    "How does a bicycle stay upright?",
)


@engine_options
def quantization(
    engine_args: EngineArgs,
    methods: Annotated[str, typer.Option(help="comma-separated: int8, int4")] = "int8,int4",
    num_prompts: Annotated[int, typer.Option("--num-prompts", help=f"at most {len(PROMPTS)}")
                           ] = len(PROMPTS),
    output_len: Annotated[int, typer.Option("--output-len", help="greedy tokens per prompt")
                          ] = 32,
    batch_sizes: Annotated[str, typer.Option("--batch-sizes", help="decode speed at these")
                           ] = "1,32",
    seed: Seed = 0,
    save_json: SaveJson = None,
) -> None:
    """Weight-only int8 / int4 (--quantization) against the unquantized model: teacher-forced
    agreement and log-probabilities on its greedy continuations, and decode speed."""
    setup_logging()
    from parashift.bench import report

    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in QUANTIZATIONS]
    if unknown or not chosen:
        fail(f"--methods {methods!r}: choose from {', '.join(QUANTIZATIONS)}")
    if not 1 <= num_prompts <= len(PROMPTS):
        fail(f"--num-prompts must be in 1..{len(PROMPTS)}")
    if output_len < 1:
        fail("--output-len must be >= 1")
    batches = parse_counts(batch_sizes, "--batch-sizes")
    if max(batches) > engine_args.max_num_seqs:
        fail(f"--batch-sizes {max(batches)} is above --max-num-seqs {engine_args.max_num_seqs}")
    if engine_args.quantization is not None:
        fail("--quantization: this command runs the methods of --methods itself")
    try:
        results = compare(dataclasses.replace(engine_args, seed=seed), chosen,
                          PROMPTS[:num_prompts], output_len, batches)
    except ValueError as e:
        fail(str(e))
    typer.echo(format_comparison(results))
    if save_json:
        report.save_json(save_json, "quantization", {
            "model": engine_args.model, "dtype": engine_args.dtype, "methods": chosen,
            "num_prompts": num_prompts, "output_len": output_len, "batch_sizes": batches,
            "seed": seed}, results)


def compare(engine_args: EngineArgs, methods: list[str], prompts: tuple[str, ...],
            output_len: int, batches: list[int]) -> dict[str, Any]:
    from parashift import LLM

    results: dict[str, Any] = {}
    reference: list[tuple[list[int], list[int], list[float]]] = []  # prompt, tokens, logprobs
    for method in [None, *methods]:
        label = method or "unquantized"
        logger.info("%s: loading", label)
        llm = LLM.from_engine_args(dataclasses.replace(engine_args, quantization=method))
        try:
            if method is None:
                logger.info("%s: %d greedy continuations", label, len(prompts))
                reference = greedy_runs(llm, [chat(llm, p) for p in prompts], output_len)
                row: dict[str, Any] = {}
            else:
                logger.info("%s: %d positions teacher-forced", label, len(prompts) * output_len)
                row = accuracy(llm, reference)
            row["weight_bytes"] = llm.engine.executor.worker.weight_bytes()
            row["decode_tok_s"] = {}
            for batch in batches:
                logger.info("%s: decode speed at batch %d", label, batch)
                row["decode_tok_s"][batch] = decode_speed(llm, batch, output_len)
        finally:
            llm.shutdown()
        results[method or "none"] = row
    return results


def greedy_runs(llm, prompts: list[list[int]], output_len: int
                ) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, greedy tokens, their log-probabilities) of every prompt."""
    from parashift import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(prompt, out.outputs[0].token_ids,
             [step[token] for step, token in zip(out.outputs[0].logprobs,
                                                 out.outputs[0].token_ids, strict=True)])
            for prompt, out in zip(prompts, outputs, strict=True)]


def chat(llm, prompt: str) -> list[int]:
    """`prompt` as a user turn of the model's chat template (plain text without one)."""
    tokenizer = llm.get_tokenizer()
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


def accuracy(llm, reference: list[tuple[list[int], list[int], list[float]]]) -> dict[str, Any]:
    """Teacher-forced on the reference's continuations, then free-running greedy."""
    from parashift import SamplingParams

    prefixes = [prompt + tokens[:t] for prompt, tokens, _ in reference for t in range(len(tokens))]
    targets = [(token, logprob) for _, tokens, logprobs in reference
               for token, logprob in zip(tokens, logprobs, strict=True)]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=NUM_TOP)
    outputs = llm.generate(prefixes, params, use_tqdm=False)
    agree, deltas = 0, []
    for out, (token, ref_logprob) in zip(outputs, targets, strict=True):
        completion = out.outputs[0]
        agree += completion.token_ids[0] == token
        if token in completion.logprobs[0]:  # else below this engine's top NUM_TOP
            deltas.append(completion.logprobs[0][token] - ref_logprob)
    output_len = len(reference[0][1])
    free = greedy_runs(llm, [prompt for prompt, _, _ in reference], output_len)
    same = [_common_prefix(tokens, ref_tokens)
            for (_, tokens, _), (_, ref_tokens, _) in zip(free, reference, strict=True)]
    return {"positions": len(targets), "top1_agreement": agree / len(targets),
            "mean_abs_logprob_delta": sum(abs(d) for d in deltas) / max(1, len(deltas)),
            "mean_logprob_delta": sum(deltas) / max(1, len(deltas)),
            "not_in_top": len(targets) - len(deltas),
            "prompts": len(reference),
            "identical_continuations": sum(n == output_len for n in same),
            "mean_identical_prefix": sum(same) / len(same)}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def decode_speed(llm, batch: int, output_len: int, rounds: int = 3) -> float:
    """Output tokens/s of `batch` 16-token prompts decoding `output_len` tokens (best round)."""
    from parashift import SamplingParams

    vocab = llm.get_tokenizer().vocab_size
    prompts = [[(100 + 7 * i + j) % vocab for j in range(16)] for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # first-call costs out
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    return batch * output_len / best


def format_comparison(results: dict[str, Any]) -> str:
    speeds = list(results["none"]["decode_tok_s"])  # may be none
    lines = [f"{'weights':<8}{'MiB':>7}{'top-1 agree':>13}{'|dlogp|':>9}{'same output':>13}"
             + "".join(f"{f'tok/s b{b}':>12}" for b in speeds)]
    for name, row in results.items():
        if name == "none":
            accuracy = f"{'reference':>13}{'':>9}{'':>13}"
        else:
            same = f"{row['identical_continuations']}/{row['prompts']}"
            accuracy = (f"{row['top1_agreement']:>13.1%}{row['mean_abs_logprob_delta']:>9.3f}"
                        f"{same:>13}")
        lines.append(f"{name:<8}{row['weight_bytes'] / 2**20:>7.0f}{accuracy}"
                     + "".join(f"{row['decode_tok_s'][b]:>12.1f}" for b in speeds))
    return "\n".join(lines)


if __name__ == "__main__":
    typer.run(quantization)
