"""The gateway's incremental detokenizer, µs per output token (``gateway/detokenizer.py``:
``make_detokenizer``, ``tokenizers``' ``DecodeStream`` under it), on the tokenizer the GPU
benchmarks serve: the default model's, padded to a dummy config's vocabulary
(``bench.model_folder``).

64 streams, each seeded with a 256-token prompt, take 64 output tokens in turn (one token per
stream per step, as the relay hands them out), for ids drawn over the whole padded vocabulary
(a dummy model's random outputs) and over the real vocabulary only (text-like ids). Writes one
JSON with the ``tokenizers`` version:

    python -m bench.detok_bench --config Qwen2.5-7B --tokenizer-dir .tokenizer --out detok.json
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

#: Streams, prompt tokens and output tokens per stream.
NUM_STREAMS, PROMPT_LEN, OUTPUT_LEN = 64, 256, 64


def time_streams(tokenizer: Any, id_range: int, seed: int = 0) -> float:
    """µs per ``add`` over ``NUM_STREAMS`` x ``OUTPUT_LEN`` tokens with ids in ``[0, id_range)``."""
    from gateway.detokenizer import make_detokenizer

    rng = random.Random(seed)
    streams = [make_detokenizer(tokenizer, [rng.randrange(id_range) for _ in range(PROMPT_LEN)])
               for _ in range(NUM_STREAMS)]
    outputs = [[rng.randrange(id_range) for _ in range(OUTPUT_LEN)] for _ in range(NUM_STREAMS)]
    start = time.perf_counter()
    for step in range(OUTPUT_LEN):
        for stream, ids in zip(streams, outputs, strict=True):
            stream.add(ids[step])
    return (time.perf_counter() - start) * 1e6 / (NUM_STREAMS * OUTPUT_LEN)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="Qwen2.5-7B", help="dummy config whose vocab_size the tokenizer is padded to")
    ap.add_argument("--tokenizer-dir", type=Path, help="tokenizer files (default: the default model's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import tokenizers
    from transformers import AutoTokenizer

    from bench.model_folder import build_model_folder
    from shared.model_source import DUMMY_CONFIGS

    with tempfile.TemporaryDirectory() as tmp:
        folder, num_fillers = build_model_folder(args.config, Path(tmp), args.tokenizer_dir)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab_size = int(DUMMY_CONFIGS[args.config]["vocab_size"])
    real_vocab = vocab_size - num_fillers
    record = {"benchmark": "detok_bench", "tokenizers": tokenizers.__version__, "config": args.config,
              "vocab_size": vocab_size, "real_vocab": real_vocab,
              "us_per_token": {"whole_padded_vocab": min(time_streams(tokenizer, vocab_size, s)
                                                         for s in range(args.repeats)),
                               "real_vocab": min(time_streams(tokenizer, real_vocab, s)
                                                 for s in range(args.repeats))}}
    print(json.dumps(record))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
