"""Schema-constrained answers through the whole product: ``--num-requests`` chat requests,
each with its own randomly built JSON schema (nested objects, arrays with item bounds,
enums, required fields, numbers and integers with bounds, strings with length limits,
booleans), sent with the official ``openai`` client (``response_format`` ``json_schema``,
``strict: true``) to ``inferq serve`` on the default model, ``--concurrency`` at a time.
Every answer must parse and validate against its schema (``jsonschema_rs``); the result
says how many did, and lists any that did not.

    python -m bench.structured_validity --out bench/results/structured_validity_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from datetime import date
from pathlib import Path
from typing import Any

from bench.host import cpu_description
from bench.procs import free_port, spawn, stop
from bench.product_bench import wait_ready

WORDS = ["red", "green", "blue", "north", "south", "alpha", "beta", "cat", "dog", "tea", "coffee", "rain"]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema of 2-4 properties drawn from the kinds the module docstring lists."""
    props: dict[str, Any] = {}
    for i in range(rng.randint(2, 4)):
        kind = rng.choice(["string", "enum", "integer", "number", "boolean", "array"]
                          + (["object"] if depth < 2 else []))
        name = f"{rng.choice(WORDS)}_{i}"
        if kind == "string":
            props[name] = {"type": "string", "minLength": 1, "maxLength": rng.randint(4, 16)}
        elif kind == "enum":
            props[name] = {"enum": rng.sample(WORDS, rng.randint(2, 4))}
        elif kind == "integer":
            lo = rng.randint(-50, 50)
            props[name] = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 200)}
        elif kind == "number":
            props[name] = {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
        elif kind == "boolean":
            props[name] = {"type": "boolean"}
        elif kind == "array":
            props[name] = {"type": "array", "items": {"enum": rng.sample(WORDS, 3)},
                           "minItems": rng.randint(0, 1), "maxItems": rng.randint(2, 3)}
        else:
            props[name] = random_schema(rng, depth + 1)
    required = list(props) if rng.random() < 0.5 else rng.sample(list(props), rng.randint(1, len(props)))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


async def run(base_url: str, model: str, schemas: list[dict[str, Any]], concurrency: int,
              max_tokens: int) -> list[dict[str, Any]]:
    """Send one request per schema; per request: whether it parsed and validated, and why not."""
    import jsonschema_rs
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, schema: dict[str, Any]) -> dict[str, Any]:
        async with gate:
            resp = await client.chat.completions.create(
                model=model, max_tokens=max_tokens, temperature=0.7, seed=i,
                messages=[{"role": "user", "content": f"Make up record number {i} as JSON."}],
                response_format={"type": "json_schema",
                                 "json_schema": {"name": f"record_{i}", "schema": schema, "strict": True}})
        text = resp.choices[0].message.content or ""
        row: dict[str, Any] = {"i": i, "finish_reason": resp.choices[0].finish_reason,
                               "completion_tokens": resp.usage.completion_tokens if resp.usage else None}
        try:
            jsonschema_rs.validate(schema, json.loads(text))
            row["valid"] = True
        except (ValueError, jsonschema_rs.ValidationError) as exc:
            row.update(valid=False, error=str(exc)[:200], text=text[:300], schema=schema)
        return row

    try:
        return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(schemas))))
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=400, help="room for the largest schema's answer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", type=Path, default=Path("/tmp/inferq-structured-validity.log"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/structured_validity_cpu.json"))
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    schemas = [random_schema(rng) for _ in range(args.num_requests)]
    port = free_port()
    proc = spawn(["-m", "shared.cli", "serve", "--port", str(port), "--max-num-seqs", str(args.concurrency),
                  "--log-level", "warning"], args.log, die_with_parent=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, args.log, 600)
        t0 = time.perf_counter()
        rows = asyncio.run(run(url, "SmolLM2-135M-Instruct", schemas, args.concurrency, args.max_tokens))
        wall_s = time.perf_counter() - t0
    finally:
        stop(proc)
    num_valid = sum(r["valid"] for r in rows)
    out = {"benchmark": "bench.structured_validity", "date": date.today().isoformat(), "host": cpu_description(),
           "model": "SmolLM2-135M-Instruct", "settings": vars(args) | {"log": str(args.log), "out": str(args.out)},
           "num_requests": len(rows), "num_valid": num_valid, "wall_s": wall_s,
           "finish_reasons": {k: sum(r["finish_reason"] == k for r in rows) for k in ("stop", "length")},
           "invalid": [r for r in rows if not r["valid"]]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"{num_valid} of {len(rows)} answers parse and validate ({wall_s:.0f} s); wrote {args.out}")
    return 0 if num_valid == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
