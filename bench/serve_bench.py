"""CLI: benchmark any OpenAI-compatible server like ``vllm bench serve --dataset-name random``.

Usage::

    python -m bench.serve_bench --base-url http://127.0.0.1:8000 --num-prompts 200 \
        --random-input-len 512 --random-output-len 128 --max-concurrency 32 --request-rate 8 \
        --goodput ttft:500 tpot:50

Prints a progress bar while running and a table at the end, and writes vLLM-compatible JSON
under ``--result-dir`` unless ``--no-save-result``.

Sweep: give several comma-separated values to ``--concurrency`` (alias of ``--max-concurrency``)
or to ``--request-rate`` (one of the two per run), e.g. ``--concurrency 1,4,16,64`` or
``--request-rate 1,2,4,inf``. Each value runs one benchmark of ``--num-prompts`` requests; the
sweep writes into ``--result-dir``/``<label or sweep>-<concurrency|rate>``: one JSON per point
(``concurrency-4.json``, vLLM's fields), ``sweep.json`` (settings and a row per point) and PNG
plots (throughput, TTFT and ITL distributions, goodput under the ``--goodput`` SLO).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Annotated

import typer

from bench.loadgen.config import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, BenchConfig
from bench.loadgen.report import print_report
from bench.loadgen.runner import run_benchmark
from bench.loadgen.sweep import CONCURRENCY_AXIS, RATE_AXIS, SweepPlan, print_sweep, run_sweep

app = typer.Typer(add_completion=False, help=__doc__)

# Options that take several space-separated values (``--goodput ttft:500 tpot:50``, as in vLLM).
MULTI_VALUE_OPTIONS = ("--goodput",)
DEFAULT_RESULT_DIR = Path("bench/results")


def parse_goodput(items: list[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` (also comma-separated) -> ``{"ttft": 500.0, "tpot": 50.0}`` in ms."""
    slos_ms: dict[str, float] = {}
    for item in (part for raw in items for part in raw.replace(",", " ").split()):
        name, sep, value = item.partition(":")
        if not sep:
            raise typer.BadParameter(f"goodput item {item!r} is not NAME:MS")
        try:
            slos_ms[name.strip().lower()] = float(value)
        except ValueError as exc:
            raise typer.BadParameter(f"goodput value in {item!r} is not a number") from exc
    return slos_ms


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``"50,90,99"`` -> ``(50.0, 90.0, 99.0)``."""
    try:
        return tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError as exc:
        raise typer.BadParameter(f"percentiles {text!r} must be comma-separated numbers") from exc


def parse_values(text: str, what: str) -> tuple[float, ...]:
    """``"1,2,4,inf"`` -> ``(1.0, 2.0, 4.0, inf)``: the values of ``--request-rate`` or ``--concurrency``."""
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise typer.BadParameter(f"{what} {text!r} must be comma-separated numbers") from exc
    if not values:
        raise typer.BadParameter(f"{what} is empty")
    return values


def sweep_plan(rates: tuple[float, ...], concurrencies: tuple[float, ...] | None) -> SweepPlan | None:
    """The sweep the two options ask for, or None for a single run (one value each).

    Raises ``typer.BadParameter`` when both have several values, or a value is out of range.
    """
    if len(rates) > 1 and concurrencies is not None and len(concurrencies) > 1:
        raise typer.BadParameter("sweep either --concurrency or --request-rate, not both")
    try:
        if len(rates) > 1:
            return SweepPlan(RATE_AXIS, rates)
        if concurrencies is not None and len(concurrencies) > 1:
            return SweepPlan(CONCURRENCY_AXIS, concurrencies)
    except AssertionError as exc:
        raise typer.BadParameter(str(exc)) from exc
    return None


def run_sweep_and_save(cfg: BenchConfig, plan: SweepPlan, result_dir: Path, save_result: bool) -> None:
    """Run the sweep, print its table, and (if ``save_result``) write JSON files and plots."""
    from bench.loadgen.plots import write_plots

    sweep = asyncio.run(run_sweep(cfg, plan))
    print_sweep(sweep)
    if not save_result:
        return
    out_dir = result_dir / f"{cfg.label or 'sweep'}-{plan.stem}"
    plots = write_plots(sweep, out_dir)
    summary = sweep.save(out_dir, [p.name for p in plots])
    typer.echo(f"saved {summary} and {len(sweep.points)} point files, plots: {', '.join(p.name for p in plots)}")


def expand_multi_value_args(argv: list[str]) -> list[str]:
    """Turn ``--goodput a b`` into ``--goodput a --goodput b`` (click has no nargs='+')."""
    out: list[str] = []
    current: str | None = None
    for arg in argv:
        if arg.startswith("-"):
            current = arg if arg in MULTI_VALUE_OPTIONS else None
            out.append(arg)
        elif current is not None and out[-1] != current:
            out += [current, arg]
        else:
            out.append(arg)
    return out


@app.command()
def main(
    base_url: Annotated[str, typer.Option(help="Server root URL.")] = "http://127.0.0.1:8000",
    endpoint: Annotated[str, typer.Option(help="/v1/completions or /v1/chat/completions.")] = COMPLETIONS_ENDPOINT,
    model: Annotated[str | None, typer.Option(help="Model name; default: first id from GET /v1/models.")] = None,
    tokenizer: Annotated[
        str | None, typer.Option(help="HF tokenizer folder/id; without one, prompts are token ids.")
    ] = None,
    random_input_len: Annotated[int, typer.Option(help="Prompt length (tokens).")] = 1024,
    random_output_len: Annotated[int, typer.Option(help="max_tokens per request.")] = 128,
    random_range_ratio: Annotated[float, typer.Option(help="Lengths uniform in [L*(1-r), L*(1+r)].")] = 0.0,
    num_prompts: Annotated[int, typer.Option(help="Number of requests.")] = 1000,
    max_concurrency: Annotated[
        str | None,
        typer.Option(
            "--max-concurrency",
            "--concurrency",
            help="Cap on in-flight requests; default none. Several (1,4,16,64): a sweep.",
        ),
    ] = None,
    request_rate: Annotated[
        str, typer.Option(help="Requests/s (Poisson); inf sends all at once. Several (1,2,4,inf): a sweep.")
    ] = "inf",
    burstiness: Annotated[float, typer.Option(help="Gamma shape of arrival gaps; 1 = Poisson.")] = 1.0,
    ignore_eos: Annotated[bool, typer.Option(help="Send ignore_eos: true.")] = False,
    seed: Annotated[int, typer.Option(help="Seed for prompts and arrivals.")] = 0,
    api_key: Annotated[str | None, typer.Option(envvar="OPENAI_API_KEY", help="Bearer token.")] = None,
    percentiles: Annotated[str, typer.Option(help="Comma-separated percentiles to report, e.g. 50,90,99.")] = "99",
    goodput: Annotated[
        list[str] | None, typer.Option(help="SLOs in ms, e.g. --goodput ttft:500 tpot:50 (ttft/tpot/e2el).")
    ] = None,
    label: Annotated[str | None, typer.Option(help="Label in the result and its file name.")] = None,
    timeout_s: Annotated[float, typer.Option(help="Per-request timeout (s).")] = 6 * 60 * 60.0,
    result_dir: Annotated[Path, typer.Option(help="Where the JSON goes.")] = DEFAULT_RESULT_DIR,
    result_filename: Annotated[str | None, typer.Option(help="File name; default follows vLLM's naming.")] = None,
    save_result: Annotated[bool, typer.Option(help="Write the result JSON.")] = True,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Run the benchmark (or a sweep), print the table, save the JSON (and a sweep's plots)."""
    if endpoint == CHAT_ENDPOINT and not tokenizer:
        raise typer.BadParameter("the chat endpoint needs --tokenizer to build text prompts")
    rates = parse_values(request_rate, "--request-rate")
    concurrencies = parse_values(max_concurrency, "--max-concurrency") if max_concurrency else None
    plan = sweep_plan(rates, concurrencies)
    if plan is not None and result_filename:
        raise typer.BadParameter("a sweep names its own files; use --result-dir and --label")
    if concurrencies is not None and not all(c.is_integer() for c in concurrencies):
        raise typer.BadParameter("--max-concurrency values must be whole numbers")
    try:
        cfg = BenchConfig(
            base_url=base_url,
            endpoint=endpoint,
            model=model,
            tokenizer=tokenizer,
            random_input_len=random_input_len,
            random_output_len=random_output_len,
            random_range_ratio=random_range_ratio,
            num_prompts=num_prompts,
            max_concurrency=int(concurrencies[0]) if concurrencies else None,
            request_rate_per_s=rates[0],
            burstiness=burstiness,
            ignore_eos=ignore_eos,
            seed=seed,
            api_key=api_key,
            percentiles=parse_percentiles(percentiles),
            goodput_slos_ms=parse_goodput(goodput or []),
            label=label,
            timeout_s=timeout_s,
            show_progress=progress,
        )
    except AssertionError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if plan is not None:
        run_sweep_and_save(cfg, plan, result_dir, save_result)
        return
    result = asyncio.run(run_benchmark(cfg))
    print_report(result)
    if save_result:
        path = result.save(result_dir, result_filename)
        typer.echo(f"saved {path}")


def run_cli() -> None:
    """Entry point: expand multi-value options, then hand argv to typer."""
    app(args=expand_multi_value_args(sys.argv[1:]), prog_name="python -m bench.serve_bench")


if __name__ == "__main__":
    run_cli()
