"""Tool calls in chat completions: OpenAI's ``tools`` and ``tool_choice`` in, ``tool_calls`` out.

The tools go into the model's own chat template (``tokenizer.apply_chat_template(tools=...)``),
which tells the model how to call them. The markup read back is the one the Qwen2.5 and Hermes
templates teach, which the demo models use::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A template without that markup is refused when a request sends tools (there is nothing to
parse back). ``tool_choice`` ``"required"`` or a named function constrains the output to one
such call of a given tool's schema with the grammar engine (an xgrammar structural tag: the
markup as fixed strings around a JSON schema), so it is a valid call by construction and exact
under speculation like every structured output (docs/structured.md). ``"auto"`` lets the model
choose and parses what it wrote; ``"none"`` leaves the tools out of the prompt.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from specdecode.config import StructuredOutput
from specdecode.engine.grammar import json_schema_ebnf

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL_PATTERN = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_TOOLS = 128  # OpenAI's limit


class ToolError(ValueError):
    """A bad ``tools``/``tool_choice``/tool message; ``param`` is the field to name in the 400."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ToolRequest:
    tools: tuple[dict[str, Any], ...]  # OpenAI's tool objects, {"type": "function", "function": {...}}
    choice: str  # "auto", "required", "none", or the name of the function to call

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(tool["function"]["name"] for tool in self.tools)

    @property
    def in_prompt(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template, None when the model must not call any."""
        return None if self.choice == "none" else list(self.tools)

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    def constraint(self) -> StructuredOutput | None:
        """The grammar of one call for ``required`` or a named function; None otherwise: the
        markup and ``{"name": "<name>", "arguments": `` as fixed text, the arguments by the
        tool's schema in compact JSON (the layout the template shows the model; free whitespace
        let a random test model wander for hundreds of tokens). Raises InvalidRequestError for a
        schema the grammar engine cannot read."""
        if self.choice in ("auto", "none"):
            return None
        chosen = [t["function"] for t in self.tools if self.choice in ("required", t["function"]["name"])]
        for f in chosen:  # the bounds on size and repetition counts every schema gets (config/sampling.py)
            StructuredOutput(json_schema=f.get("parameters") or {"type": "object"})
        calls = [{"type": "sequence", "elements": [
            {"type": "const_string", "value": f'{{"name": "{f["name"]}", "arguments": '},
            {"type": "grammar", "grammar": json_schema_ebnf(f.get("parameters") or {"type": "object"})},
            {"type": "const_string", "value": "}"},
        ]} for f in chosen]
        return StructuredOutput(structural_tag={"type": "structural_tag", "format": {"type": "sequence", "elements": [
            {"type": "const_string", "value": OPEN + "\n"},
            calls[0] if len(calls) == 1 else {"type": "or", "elements": calls},
            {"type": "const_string", "value": "\n" + CLOSE},
        ]}})


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """``tools`` and ``tool_choice`` of a chat request, checked; None when it sends no tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolError("'tool_choice' needs 'tools': give the functions the model may call.", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError(f"'tools' must be a list of at most {MAX_TOOLS} {{'type': 'function', 'function': ...}} "
                        "objects.", "tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ToolError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                            "{...}}}}.", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise ToolError(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-'; got {name!r:.40}.",
                            "tools")
        if name in seen:
            raise ToolError(f"tools[{i}]: the function name {name!r} is given twice.", "tools")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object.", "tools")
        if not isinstance(function.get("description", ""), str):
            raise ToolError(f"tools[{i}].function.description must be a string.", "tools")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ToolError("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                            "{'name': ...}}.", "tool_choice")
        if name not in seen:
            raise ToolError(f"'tool_choice' names the function {name!r:.40}, which is not among the tools "
                            f"({', '.join(sorted(seen))}).", "tool_choice")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise ToolError(f"'tool_choice' must be 'none', 'auto', 'required' or a named function, got {choice!r:.40}.",
                        "tool_choice")
    return ToolRequest(tuple(tools), choice)


def tool_message(message: dict[str, Any], index: int, content: str | None) -> dict[str, Any]:
    """A chat message of role ``tool`` or an assistant message with ``tool_calls``, for the
    template: arguments as objects (the Qwen template writes them with ``tojson``)."""
    if message.get("role") == "tool":
        if content is None:
            raise ToolError(f"messages[{index}] (role 'tool') needs the tool's result as its content.", "messages")
        out = {"role": "tool", "content": content}
        if isinstance(message.get("tool_call_id"), str):
            out["tool_call_id"] = message["tool_call_id"]
        return out
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        raise ToolError(f"messages[{index}].tool_calls must be a non-empty list.", "messages")
    parsed = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolError(f"messages[{index}].tool_calls[{j}] needs a function with a name.", "messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as err:
                raise ToolError(f"messages[{index}].tool_calls[{j}].function.arguments is not JSON: {err}.",
                                "messages") from err
        parsed.append({"id": call.get("id"), "type": "function",
                       "function": {"name": function["name"], "arguments": arguments}})
    return {"role": "assistant", "content": content or "", "tool_calls": parsed}


def split_tool_calls(text: str, names: tuple[str, ...]) -> tuple[str | None, list[dict[str, Any]]]:
    """The text's tool calls in OpenAI's shape and the content left around them (None when
    nothing is left). A block that is not JSON or names no given tool stays in the content."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in CALL_PATTERN.finditer(text):
        call = _call(match.group(1), names)
        if call is None:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None) if calls else (text or None), calls


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(body: str, names: tuple[str, ...]) -> dict[str, Any] | None:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if not isinstance(arguments, str):
        # The arguments as the model wrote them where a stream would have sent them so (the
        # usual layout), so that a whole reply's and a stream's arguments are the same string.
        header = _read_header(OPEN + body, names)
        written = _object_end(OPEN + body, header[2]) if header[0] == "match" else None
        raw = (OPEN + body)[header[2]:written] if written is not None else None
        arguments = raw if raw is not None and json.loads(raw) == arguments else json.dumps(arguments,
                                                                                             ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": data["name"], "arguments": arguments}}


# What follows the opening markup of a call whose arguments can be streamed: the layout the
# Qwen2.5 and Hermes templates teach, and the one the tool-call grammar writes.
_HEADER = ("{", '"name"', ":", None, ",", '"arguments"', ":", "{")  # None: the function's name, a JSON string
_NAME_CHARS = re.compile(r"[A-Za-z0-9_-]*")


def _read_header(text: str, names: tuple[str, ...]) -> tuple[str, str, int]:
    """How ``text`` (which begins ``<tool_call>``) opens: ``("match", name, at)`` when it is
    ``{"name": "<one of names>", "arguments": {`` (any whitespace between), ``at`` the index of
    the arguments' ``{``; ``("maybe", "", 0)`` while it may still become one; ``("no", "", 0)``."""
    pos, name = len(OPEN), ""
    for expected in _HEADER:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return "maybe", "", 0
        if expected is None:
            if text[pos] != '"':
                return "no", "", 0
            word = _NAME_CHARS.match(text, pos + 1)
            assert word is not None  # the pattern matches the empty string
            end = word.end()
            if end == len(text):
                return ("maybe", "", 0) if any(n.startswith(word.group()) for n in names) else ("no", "", 0)
            if text[end] != '"' or word.group() not in names:
                return "no", "", 0
            name, pos = word.group(), end + 1
            continue
        piece = text[pos:pos + len(expected)]
        if not expected.startswith(piece):
            return "no", "", 0
        if len(piece) < len(expected):
            return "maybe", "", 0
        pos += len(expected)
    return "match", name, pos - 1


def _object_end(text: str, start: int) -> int | None:
    """The index after the JSON object that opens at ``text[start]`` (``{``), None when the text
    ends first. Counts brackets outside strings; whether it is valid JSON is not checked here."""
    scan = _JsonScan()
    for i in range(start, len(text)):
        if scan.step(text[i]):
            return i + 1
    return None


class _JsonScan:
    """Where a JSON value made of objects and arrays closes, read a character at a time."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False

    def step(self, char: str) -> bool:
        """Read ``char``; True when it closes the outermost bracket."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
            return False
        if char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


CallDelta = dict[str, Any]  # a chat chunk's tool_calls entry: {"index", "id"?, "type"?, "function": {...}}


class ToolStream:
    """Streamed text split into content and tool calls, as vLLM's and OpenAI's streams send them.

    Text that may begin a ``<tool_call>`` is held back until it is known not to. A call in the
    usual layout (``{"name": "<tool>", "arguments": {``, the one the templates teach and the
    grammar of ``required`` writes) is sent as it decodes: a first delta with its ``id``,
    ``type`` and ``name`` and empty ``arguments``, then the arguments' text in pieces, each
    with the call's ``index``; the markup after the arguments is dropped. A block in another
    layout is held, with all the text after it, and parsed when the generation ends
    (``split_tool_calls``), its calls sent whole. A streamed call is sent before the end of its
    block is seen: one cut by max_tokens, or whose arguments are not JSON, stays a call (with
    those arguments), where a whole reply leaves such a block in its content.
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self._pending = ""  # text not yet sent: a possible start of OPEN, or a call's markup
        self._mode = "content"  # content, header (after OPEN), arguments, after (the markup to CLOSE), held
        self._scan = _JsonScan()
        self.calls = 0  # calls sent so far (the next call's index)

    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        """The content and the call deltas that ``delta`` (with what was held back) makes sure."""
        self._pending += delta
        content: list[str] = []
        calls: list[CallDelta] = []
        while self._step(content, calls):
            pass
        return "".join(content), calls

    def _step(self, content: list[str], calls: list[CallDelta]) -> bool:
        """Advance through the pending text as far as it is sure; True to go on."""
        if self._mode == "content":
            at = self._pending.find(OPEN)
            if at >= 0:
                if not self.calls or self._pending[:at].strip():  # whitespace between calls is dropped
                    content.append(self._pending[:at])
                self._pending, self._mode = self._pending[at:], "header"
                return True
            hold = _partial_suffix(self._pending, OPEN)
            sure = self._pending[: len(self._pending) - hold]
            if self.calls and not sure.strip():
                return False  # whitespace after a call: held, and dropped if nothing else follows
            content.append(sure)
            self._pending = self._pending[len(sure):]
            return False
        if self._mode == "header":
            found, name, at = _read_header(self._pending, self.names)
            if found == "no":
                self._mode = "held"
            elif found == "match":
                calls.append({"index": self.calls, "id": new_call_id(), "type": "function",
                              "function": {"name": name, "arguments": ""}})
                self._pending, self._mode, self._scan = self._pending[at:], "arguments", _JsonScan()
                return True
            return False
        if self._mode == "arguments":
            for i, char in enumerate(self._pending):
                if self._scan.step(char):
                    self._send(self._pending[: i + 1], calls)
                    self._pending, self._mode = self._pending[i + 1:], "after"
                    self.calls += 1
                    return True
            self._send(self._pending, calls)
            self._pending = ""
            return False
        if self._mode == "after":
            at = self._pending.find(CLOSE)
            if at < 0:
                return False
            self._pending, self._mode = self._pending[at + len(CLOSE):], "content"
            return True
        return False  # held: parsed at the end

    def _send(self, arguments: str, calls: list[CallDelta]) -> None:
        if arguments:
            calls.append({"index": self.calls, "function": {"arguments": arguments}})

    def finish(self) -> tuple[str, list[CallDelta]]:
        """The content still held and the calls parsed from it, whole (their ``index`` after the
        streamed ones'). A streamed call cut before its end is over: its markup is dropped."""
        held, self._pending = self._pending, ""
        if self._mode in ("arguments", "after"):
            if self._mode == "arguments":
                self.calls += 1
            self._mode = "content"
            return "", []
        content, calls = split_tool_calls(held, self.names)
        if not calls:
            return ("" if self.calls and not held.strip() else held), []
        first, self.calls = self.calls, self.calls + len(calls)
        return content or "", [{"index": first + i, **call} for i, call in enumerate(calls)]

    @property
    def called(self) -> bool:
        return self.calls > 0


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
