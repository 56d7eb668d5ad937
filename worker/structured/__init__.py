"""Structured outputs in the engine: grammar masks over the logits (docs/architecture.md,
"Structured outputs (worker)").

- ``tokenizer``: the model's llguidance tokenizer, built once (lazily) per engine.
- ``cache``: compiled grammars keyed by ``StructuredOutput`` (LRU); a deep copy per request.
- ``matcher``: one request's ``GrammarMatcher``; ``Request.append_token`` advances it.
- ``bitmask``: a step's bitmask rows, filled by llguidance's threads, copied to the device.
- ``mask``: ``apply_token_bitmask_``, our torch op that sets disallowed logits to -inf.
"""
