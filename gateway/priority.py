"""A request's priority class (docs/operations.md, "Priority classes and fair share").

The class comes from the ``X-Priority`` header (a class name: ``interactive``,
``default`` or ``batch``, any case) or else from vLLM's body field ``priority``, an
integer where lower is more urgent: below 0 is ``interactive``, 0 ``default``, above 0
``batch``. The header wins when both are given, so a Batch API line (sent with
``X-Priority: batch`` by worker/batch_jobs.py) always lands in the lowest class whatever
its body says. Neither: ``default``. The class's rank (``shared.fair_queue.class_rank``)
travels as ``GenerateRequest.priority``, which the engine's scheduler orders by.
"""

from __future__ import annotations

from starlette.requests import Request

from gateway.errors import OpenAIError
from shared.fair_queue import DEFAULT_CLASS, HIGHEST_CLASS, LOWEST_CLASS, PRIORITY_CLASSES, PRIORITY_HEADER


def class_of_priority(priority: int) -> str:
    """The class of vLLM's integer ``priority``: <0 the highest (interactive), 0 the
    default, >0 the lowest (batch)."""
    if priority < 0:
        return HIGHEST_CLASS
    return DEFAULT_CLASS if priority == 0 else LOWEST_CLASS


def request_class(request: Request, body_priority: int | None) -> str:
    """The class of ``request``: its ``X-Priority`` header, else ``body_priority``, else
    ``default``.

    Raises:
        OpenAIError: 400 for a header that names no class.
    """
    header = request.headers.get(PRIORITY_HEADER)
    if header is not None:
        name = header.strip().lower()
        if name not in PRIORITY_CLASSES:
            raise OpenAIError(400, f"{PRIORITY_HEADER} must be one of {', '.join(PRIORITY_CLASSES)}; "
                              f"got {header[:40]!r}", param=PRIORITY_HEADER, code="invalid_priority")
        return name
    return DEFAULT_CLASS if body_priority is None else class_of_priority(body_priority)
