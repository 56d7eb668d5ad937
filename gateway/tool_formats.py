"""The ways a model writes a tool call, and which one a chat template teaches
(docs/operations.md, "Tool calling"). One home for the delimiters: the prompt and the
forcing grammar (gateway/tools.py) write them, the parser (gateway/tool_parser.py)
reads them.

- **Hermes** (Qwen 2.5, SmolLM2-style ChatML, and our own tools prompt for templates
  that do not render ``tools``): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one tagged block per call, anywhere in the text.
- **Llama 3 JSON** (Llama 3.1, 3.2, 3.3 chat templates): a bare JSON object
  ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>`` (a special
  token, so usually gone from the detokenized text), several separated by ``;``; only
  at the start of the output (vLLM's ``llama3_json`` parser, same rule).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """The delimiters of one tool-call format.

    ``call_close`` empty means untagged: a call is a bare JSON object at the start of the
    output (``call_open`` optional before it), calls separated by ``separator``; with a
    ``call_close``, a call is a ``call_open`` ... ``call_close`` block anywhere in the text.
    ``arguments_key`` is the key the forcing grammar writes (the parser reads ``arguments``
    and ``parameters`` in both formats). ``grammar_open``, ``grammar_close`` and
    ``grammar_separator`` are what the forcing grammar writes around and between calls.
    """

    name: str  # vLLM's --tool-call-parser name of the same format
    call_open: str
    call_close: str
    separator: str
    arguments_key: str
    grammar_open: str
    grammar_close: str
    grammar_separator: str

    @property
    def tagged(self) -> bool:
        """True when calls are tagged blocks that may stand anywhere in the text."""
        return bool(self.call_close)


HERMES = ToolFormat(name="hermes", call_open="<tool_call>", call_close="</tool_call>", separator="",
                    arguments_key="arguments", grammar_open="<tool_call>\n", grammar_close="\n</tool_call>",
                    grammar_separator="\n")
LLAMA3_JSON = ToolFormat(name="llama3_json", call_open="<|python_tag|>", call_close="", separator=";",
                         arguments_key="parameters", grammar_open="", grammar_close="", grammar_separator="; ")
#: Text that only a Llama 3.x tools template contains: the token before a built-in tool
#: call, and the answer format its tools prompt asks for.
_LLAMA3_MARKERS = ("<|python_tag|>", '"parameters": dictionary of argument name')


def tool_format_for_template(chat_template: str | dict[str, str] | None) -> ToolFormat:
    """The tool-call format that ``chat_template`` (a tokenizer's ``chat_template``: one
    Jinja source, or named sources such as ``{"default": ..., "tool_use": ...}``) teaches
    its model: ``HERMES`` when a template that renders ``tools`` mentions ``<tool_call>``,
    ``LLAMA3_JSON`` when one mentions ``<|python_tag|>`` or Llama 3's ``"parameters":
    dictionary of argument name ...`` instruction, else ``HERMES`` (a template that does
    not render ``tools`` gets our Hermes tools prompt: gateway/tools.py)."""
    if isinstance(chat_template, dict):
        sources = [chat_template["tool_use"]] if "tool_use" in chat_template else list(chat_template.values())
    else:
        sources = [] if chat_template is None else [chat_template]
    rendering = [s for s in sources if "tools" in s]
    if any(HERMES.call_open in s for s in rendering):
        return HERMES
    if any(marker in s for s in rendering for marker in _LLAMA3_MARKERS):
        return LLAMA3_JSON
    return HERMES
