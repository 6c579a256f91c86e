"""``POST /infill``: llama-server's fill-in-the-middle for code editors, as a translation onto
``/v1/completions``.

The request's ``input_prefix``, ``input_suffix``, ``prompt`` (text to continue the prefix with)
and ``input_extra`` (other files: a list of ``{filename, text}``) become token ids in the layout
llama-server builds (tools/server ``format_infill``, the repo-level FIM pattern of the
Qwen2.5-Coder report)::

    <|repo_name|>myproject\\n <|file_sep|>{filename}\\n{text} ... <|file_sep|>filename\\n
    [BOS] <|fim_prefix|>{input_prefix}{prompt} <|fim_suffix|>{input_suffix} <|fim_middle|>

with the model's own FIM tokens (``FIM_FAMILIES``); without a repo or file-separator token the
extra files are joined by llama-server's ``--- snippet ---`` separator. The ids and the
sampling fields (llama-server's ``n_predict`` read as ``max_tokens``) then go through
``ServerState.prepare`` as a completion whose prompt is those ids, and decode like any other:
speculation, prefix caching, limits, metrics and errors are the completions route's. Only the
response is reshaped, to llama-server's ``{content, stop, tokens_predicted, ...}`` (streamed:
one such event per chunk, the last with ``stop: true``).

A model whose tokenizer has no FIM tokens gets a 400 naming it. Extra files that do not fit the
context are cut from the front, as llama-server cuts them; a prefix and suffix that alone do not
fit get the completions route's 400.
"""

# No ``from __future__ import annotations``: FastAPI reads the endpoint's signature
# (``request: Request``, imported inside ``add_infill_route``) at definition time.
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from specdecode.serving.api_errors import APIError
from specdecode.serving.protocol import DEFAULT_CHAT_MAX_TOKENS
from specdecode.serving.responses import sse
from specdecode.serving.state import ServerState
from specdecode.serving.unicode_check import check_unicode
from specdecode.serving.utility_routes import check_text_chars, load_body

# FIM token names by model family: prefix, suffix, middle, repo name, file separator (None:
# the family has none). Qwen2.5-Coder and CodeGemma; StarCoder; DeepSeek-Coder.
FIM_FAMILIES: tuple[tuple[str, str, str, str | None, str | None], ...] = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<reponame>", "<file_sep>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", None, None),
)
# llama-server's fixed names in the repo-level layout (it has no field for them yet).
PROJECT_NAME = "myproject"
CURRENT_FILE_NAME = "filename"
EXTRA_FILE_NAME = "tmp"  # an extra chunk without a filename
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"  # between extra chunks, for a model without <|file_sep|>
# Fields only /infill reads; the rest of the body is a completion request's.
INFILL_FIELDS = ("input_prefix", "input_suffix", "input_extra", "prompt", "n_predict", "stream_options")


@dataclass(slots=True, frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    repo: int | None  # <|repo_name|>: opens the extra files
    separator: int | None  # <|file_sep|>: before each file's name
    bos: int | None  # the BOS the tokenizer adds to a prompt, if it adds one


def find_fim_tokens(tokenizer: Any) -> FimTokens | None:
    """The FIM tokens of ``tokenizer``'s vocabulary (the first family it has whole), or None."""
    vocab = tokenizer.get_vocab()
    for prefix, suffix, middle, repo, separator in FIM_FAMILIES:
        if prefix in vocab and suffix in vocab and middle in vocab:
            bos = getattr(tokenizer, "bos_token_id", None)
            adds_bos = bos is not None and list(tokenizer("a", add_special_tokens=True)["input_ids"][:1]) == [bos]
            return FimTokens(vocab[prefix], vocab[suffix], vocab[middle], vocab.get(repo) if repo else None,
                             vocab.get(separator) if separator else None, bos if adds_bos else None)
    return None


def _text(body: dict[str, Any], name: str) -> str:
    value = body.get(name, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise APIError(400, f"'{name}' must be a string.", name)
    return value


def _extra_files(body: dict[str, Any]) -> list[tuple[str, str]]:
    """``input_extra`` as (filename, text) pairs."""
    chunks = body.get("input_extra") or []
    if not isinstance(chunks, list):
        raise APIError(400, "'input_extra' must be a list of {\"filename\": ..., \"text\": ...} objects.", "input_extra")
    files = []
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text", ""), str) \
                or not isinstance(chunk.get("filename", EXTRA_FILE_NAME), str):
            raise APIError(400, f"input_extra[{i}] must be an object with a string 'text' and an optional string "
                                "'filename'.", "input_extra")
        files.append((chunk.get("filename", EXTRA_FILE_NAME), chunk.get("text", "")))
    return files


def infill_prompt(tokenizer: Any, fim: FimTokens, prefix: str, suffix: str, prompt: str,
                  files: list[tuple[str, str]], most_tokens: int) -> list[int]:
    """Token ids in llama-server's FIM layout (the module's docstring); the extra files' tokens
    are cut from the front to keep the whole within ``most_tokens`` where the rest fits."""

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    extra: list[int] = []
    if fim.repo is not None:
        extra += [fim.repo, *encode(PROJECT_NAME + "\n")]
    for filename, text in files:
        extra += [fim.separator, *encode(filename + "\n")] if fim.separator is not None else encode(SNIPPET_SEPARATOR)
        extra += encode(text)
    if fim.separator is not None:
        extra += [fim.separator, *encode(CURRENT_FILE_NAME + "\n")]
    core = [fim.prefix, *encode(prefix), *encode(prompt), fim.suffix, *encode(suffix), fim.middle]
    if fim.bos is not None:
        core.insert(0, fim.bos)
    keep = max(0, most_tokens - len(core))
    return extra[len(extra) - min(keep, len(extra)):] + core


def to_completion(raw: bytes, state: ServerState, fim: FimTokens | None) -> bytes:
    """An /infill body as the /v1/completions body that decodes it: its prompt the FIM token
    ids, its sampling fields as given (``n_predict`` as ``max_tokens``)."""
    body = load_body(raw, state)
    if state.draining:  # the guard refuses new /v1/ requests while draining; /infill is outside /v1/
        raise APIError(503, "The server is shutting down and takes no new requests; retry on another instance.",
                       code="server_shutting_down", kind="server_error")
    if fim is None:
        raise APIError(400, f"The model {state.model_name} has no fill-in-the-middle tokens in its tokenizer (such as "
                            "<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>), so /infill cannot serve it; use a code "
                            "model trained for FIM (Qwen2.5-Coder) or send a plain /v1/completions request.",
                       "input_prefix", "fim_not_supported")
    check_unicode(body)
    if body.get("n", 1) != 1:
        raise APIError(400, "/infill makes one completion; leave 'n' out.", "n")
    prefix, suffix, prompt = _text(body, "input_prefix"), _text(body, "input_suffix"), _text(body, "prompt")
    files = _extra_files(body)
    chars = len(prefix) + len(suffix) + len(prompt) + sum(len(name) + len(text) for name, text in files)
    check_text_chars(state, chars, "input_prefix")
    most = state.max_prompt_tokens()
    ids = infill_prompt(state.decoder.tokenizer, fim, prefix, suffix, prompt, files, most)
    completion = {key: value for key, value in body.items() if key not in INFILL_FIELDS}
    completion["prompt"] = ids
    n_predict = body.get("n_predict")
    if isinstance(n_predict, int) and not isinstance(n_predict, bool) and n_predict >= 0:
        completion["max_tokens"] = n_predict
    elif completion.get("max_tokens") is None:  # llama-server's -1, "to the end": as chat's default
        completion["max_tokens"] = max(1, min(DEFAULT_CHAT_MAX_TOKENS, most + 1 - len(ids)))
    return json.dumps(completion).encode()


def _stop_type(finish_reason: str | None) -> str:
    return "limit" if finish_reason == "length" else "eos"


def llama_body(reply: dict[str, Any]) -> dict[str, Any]:
    """A whole /v1/completions reply as llama-server's /infill (and /completion) reply."""
    choice, usage = reply["choices"][0], reply["usage"]
    return {"index": 0, "content": choice["text"], "tokens": [], "id_slot": -1, "stop": True, "model": reply["model"],
            "tokens_predicted": usage["completion_tokens"], "tokens_evaluated": usage["prompt_tokens"],
            "tokens_cached": usage["prompt_tokens_details"]["cached_tokens"], "truncated": False,
            "stop_type": _stop_type(choice["finish_reason"]), "stopping_word": "", "specdecode": reply["specdecode"]}


async def llama_events(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A /v1/completions event stream (one choice, usage on its last chunk) as llama-server's:
    ``{content, stop: false}`` per chunk, then the whole reply's fields with ``stop: true``; an
    error event passes as it is. No ``[DONE]``: llama-server's own stream has none."""
    async for event in events:
        payload = event[len("data: "):].strip()
        if payload == "[DONE]":
            continue
        chunk = json.loads(payload)
        if "error" in chunk or not chunk.get("choices"):
            yield event
            continue
        choice = chunk["choices"][0]
        if choice["finish_reason"] is None:
            if choice["text"]:
                yield sse({"index": 0, "content": choice["text"], "tokens": [], "id_slot": -1, "stop": False})
            continue
        yield sse(llama_body(chunk))


Respond = Callable[..., Awaitable[Any]]  # server.py's respond(request, chat, translate=...)


def add_infill_route(app: Any, state: ServerState, respond: Respond) -> None:
    """Register ``POST /infill`` on ``app``: ``to_completion`` then the completions route."""
    from fastapi import Request
    from fastapi.responses import StreamingResponse

    from specdecode.serving.openapi import utility_body

    fim = find_fim_tokens(state.decoder.tokenizer)  # once: get_vocab copies the whole vocabulary

    def translate(raw: bytes) -> bytes:
        try:
            return to_completion(raw, state, fim)
        except APIError:
            state.metrics.count("rejected")  # as ServerState.prepare counts the completions route's
            raise

    @app.post("/infill", openapi_extra={"requestBody": utility_body("/infill", state.served_names,
                                                                              len(state.decoder.tokenizer))})
    async def infill(request: Request) -> Any:
        reply = await respond(request, False, translate=translate)
        if isinstance(reply, dict):
            return llama_body(reply)
        if isinstance(reply, StreamingResponse):
            reply.body_iterator = llama_events(reply.body_iterator)
        return reply
