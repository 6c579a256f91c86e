"""llama.cpp's own binaries as benchmark peers: ``llama-speculative-simple`` (a draft model) and
``llama-lookup`` (n-gram lookup), as the repository's scripts/build-llamacpp-tools.sh builds them
from the source llama-cpp-python 0.3.36 vendors.

Each turn is one run of the binary on the prompt (greedy: ``--temp 0``), under a timeout. What
we read back, from the formats in the binaries' source (examples/speculative-simple/
speculative-simple.cpp and examples/lookup/lookup.cpp):

- stdout (their ``LOG``): ``"\\n\\n"``, the prompt's tokens as text, the generated tokens as
  text, then ``"\\n\\n"`` twice. speculative-simple stops before printing an end-of-generation
  token; lookup prints it (special tokens are rendered), and may print tokens sampled past it
  in the same step, so the text is cut at the first end token.
- stderr (their ``LOG_INF``): ``encoded %4d tokens in %8.3f seconds, speed: %8.3f t/s``,
  ``decoded %4d tokens in %8.3f seconds, ...``, ``n_predict = %d``, ``n_drafted = %d``,
  ``n_accept = %d``; lookup also ``t_draft = %.2f ms, ...``.

Limits, said where they bite:
- the binaries print text, not token ids, so the tokens compared and counted are the text
  re-encoded by our tokenizer (greedy text from the same model almost always re-encodes to the
  same ids; where it does not, the equality check reports a difference), plus the target's
  first end token when the binary stopped at one (which end token it was is not printed);
- the binaries decode past ``-n`` (speculative-simple exactly one token more, which we ask
  for by passing ``-n max_new_tokens - 1``; lookup up to a whole step more), so the tokens are
  cut at max_new_tokens and the decode seconds scaled by the share kept;
- prefill is the binary's "encoded" time (speculative-simple leaves the prompt's last token to
  the first decode pass); the draft share is printed by lookup only;
- a step emits accepted + 1 tokens in both binaries, so their verify steps are n_predict -
  n_accept (the basis of tau); speculative-simple runs one draft-model pass per drafted token.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdecode.bench.methods import LLAMACPP_BIN_METHODS, TurnResult
from specdecode.config import SamplingParams
from specdecode.errors import InvalidRequestError

BINARIES = {"llamacpp-bin-draft": "llama-speculative-simple", "llamacpp-bin-lookup": "llama-lookup"}
DEFAULT_BIN_TIMEOUT_SECONDS = 600.0  # one turn; a hung binary must not stall the whole run
STDOUT_LEAD = "\n\n"  # printed before the prompt
STDOUT_TAIL = "\n\n\n\n"  # printed after the generation (two LOG("\n\n") calls)
_FLOAT = r"([0-9.]+|nan|-nan|inf)"
_PATTERNS = {
    "encoded": re.compile(rf"encoded\s+(\d+) tokens in\s+{_FLOAT} seconds"),
    "decoded": re.compile(rf"decoded\s+(\d+) tokens in\s+{_FLOAT} seconds"),
    "n_drafted": re.compile(r"n_drafted\s*=\s*(\d+)"),
    "n_accept": re.compile(r"n_accept\s*=\s*(\d+)"),
    "t_draft": re.compile(rf"t_draft\s*=\s*{_FLOAT} ms"),
}


class BinaryOutputError(InvalidRequestError):
    """A binary's output lacks what the format in its source promises (another version?)."""


@dataclass(frozen=True, slots=True)
class BinaryRun:
    """What one run of llama-speculative-simple or llama-lookup reported."""

    text: str  # the generated text, cut at the first end token
    stopped_at_end: bool  # the generation ended at an end-of-generation token
    prompt_tokens: int
    encode_seconds: float
    decoded_tokens: int
    decode_seconds: float
    drafted: int
    accepted: int
    draft_seconds: float | None  # lookup's t_draft; None where the binary prints none

    @property
    def tokens_per_second(self) -> float | None:
        return self.decoded_tokens / self.decode_seconds if self.decode_seconds > 0 else None


def _number(text: str, key: str, group: int = 1, required: bool = True) -> float | None:
    match = _PATTERNS[key].search(text)
    if match is None:
        if required:
            raise BinaryOutputError(f"the binary's log has no {key!r} line; is it the llama.cpp the bench was written for (0.3.36)?")
        return None
    value = match.group(group)
    return float("nan") if "nan" in value else float(value)


def parse_binary_output(stdout: str, stderr: str, prompt: str, end_texts: tuple[str, ...] = ()) -> BinaryRun:
    """The figures and generated text of one run. ``prompt`` is the text passed with ``-p``
    (the binary echoes it first); ``end_texts`` are the end-of-generation tokens as text."""
    printed = stdout.removeprefix(STDOUT_LEAD)
    start = printed.find(prompt)
    if start < 0:
        raise BinaryOutputError("the binary's output does not echo the prompt; cannot tell the generated text apart")
    text = printed[start + len(prompt) :].removesuffix(STDOUT_TAIL)
    ends = [i for i in (text.find(end) for end in end_texts if end) if i >= 0]
    stopped = bool(ends)
    if ends:
        text = text[: min(ends)]
    encoded = _PATTERNS["encoded"].search(stderr)
    decoded = _PATTERNS["decoded"].search(stderr)
    if encoded is None or decoded is None:
        raise BinaryOutputError("the binary's log has no 'encoded ... tokens' / 'decoded ... tokens' lines; did it fail?")
    draft_ms = _number(stderr, "t_draft", required=False)
    return BinaryRun(
        text=text,
        stopped_at_end=stopped,
        prompt_tokens=int(encoded.group(1)),
        encode_seconds=float(encoded.group(2)),
        decoded_tokens=int(decoded.group(1)),
        decode_seconds=float(decoded.group(2)),
        drafted=int(_number(stderr, "n_drafted")),
        accepted=int(_number(stderr, "n_accept")),
        draft_seconds=draft_ms / 1000 if draft_ms is not None else None,
    )


def find_binary(folder: Path, method: str) -> Path:
    """The binary a method runs, or an error that says how to build it."""
    path = Path(folder).expanduser() / BINARIES[method]
    if not path.is_file():
        raise InvalidRequestError(
            f"Method {method} runs {BINARIES[method]}, which is not in llamacpp_bin={str(folder)!r}: build llama.cpp's tools "
            "with `bash scripts/build-llamacpp-tools.sh` from specdecode's repository (about 10 minutes) and pass the folder it prints."
        )
    return path


class LlamaCppBinaryMethod:
    """``llamacpp-bin-draft`` / ``llamacpp-bin-lookup``: one run of llama.cpp's binary per turn."""

    def __init__(
        self,
        name: str,
        folder: Path,
        target: Path,
        draft: Path | None,
        tokenizer: Any,
        eos_token_ids: list[int],
        *,
        threads: int,
        context: int,
        exact: bool,
        k: int | None,
        timeout: float = DEFAULT_BIN_TIMEOUT_SECONDS,
    ) -> None:
        if name not in LLAMACPP_BIN_METHODS:
            raise InvalidRequestError(f"Unknown llama.cpp binary method {name!r}; choose one of: {', '.join(LLAMACPP_BIN_METHODS)}.")
        if name == "llamacpp-bin-draft" and draft is None:
            raise InvalidRequestError("llamacpp-bin-draft needs a draft model: pass a .gguf file as draft=.")
        self.name = name
        self.binary = find_binary(folder, name)
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.end_texts = tuple(tokenizer.decode([i], skip_special_tokens=False) for i in eos_token_ids)
        self.timeout = timeout
        # --no-escape: the prompt goes in verbatim (code holds backslashes); -ngl 0: the CPU, as
        # every llama.cpp method here; exact (dtype fp32) mirrors our backend: f32 cache, no flash attention.
        self.fixed_args = ["-m", str(target), "-t", str(threads), "-c", str(context), "--temp", "0", "--no-escape", "-ngl", "0"]
        if exact:
            self.fixed_args += ["-fa", "off", "-ctk", "f32", "-ctv", "f32"]
        if k is not None:
            self.fixed_args += ["--spec-draft-n-max", str(k)]
        if name == "llamacpp-bin-draft":
            # --spec-type: this llama.cpp infers the speculation type from the draft GGUF's metadata
            # only, and a plain model file carries none, so without it the binary refuses to start.
            self.fixed_args += ["-md", str(draft), "-ngld", "0", "--spec-type", "draft-simple"]

    def command(self, prompt: str, max_new_tokens: int) -> list[str]:
        # speculative-simple stops once it has decoded more than -n tokens: one more than asked.
        predict = max_new_tokens - 1 if self.name == "llamacpp-bin-draft" else max_new_tokens
        return [str(self.binary), *self.fixed_args, "-n", str(max(predict, 1)), "-p", prompt]

    def run_turn(self, prompt_ids: list[int], params: SamplingParams) -> TurnResult:
        if params.temperature > 0:
            raise InvalidRequestError(f"{self.name} is run greedy only (--temp 0); use temperature=0.")
        prompt = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)  # the binary re-tokenizes it
        try:
            done = subprocess.run(self.command(prompt, params.max_new_tokens), capture_output=True, text=True,
                                  errors="replace", timeout=self.timeout, check=False)
        except subprocess.TimeoutExpired as err:
            raise InvalidRequestError(f"{self.binary.name} took more than {self.timeout:.0f} s on this prompt") from err
        if done.returncode != 0:
            tail = " | ".join(done.stderr.strip().splitlines()[-3:])
            raise InvalidRequestError(f"{self.binary.name} exited with status {done.returncode}: {tail}")
        run = parse_binary_output(done.stdout, done.stderr, prompt, self.end_texts)
        return binary_turn(run, self.tokenizer, self.eos_token_ids, len(prompt_ids), params.max_new_tokens,
                           draft_model=self.name == "llamacpp-bin-draft")


def binary_turn(
    run: BinaryRun, tokenizer: Any, eos_token_ids: list[int], prompt_tokens: int, max_new_tokens: int, draft_model: bool
) -> TurnResult:
    """A binary's run as a TurnResult (the rules in the module docstring)."""
    tokens = tokenizer.encode(run.text, add_special_tokens=False)
    if run.stopped_at_end and eos_token_ids:
        tokens.append(eos_token_ids[0])
    tokens = tokens[:max_new_tokens]
    kept = min(1.0, len(tokens) / run.decoded_tokens) if run.decoded_tokens else 1.0
    decode = run.decode_seconds * kept
    draft = (run.draft_seconds or 0.0) * kept
    steps = max(run.decoded_tokens - run.accepted, 0)
    return TurnResult(
        tokens=tokens,
        text=tokenizer.decode(tokens, skip_special_tokens=True),
        prompt_tokens=prompt_tokens,
        seconds=run.encode_seconds + decode,
        prefill_seconds=run.encode_seconds,
        draft_seconds=draft,
        verify_seconds=max(decode - draft, 0.0),
        target_passes=steps + 1,
        draft_passes=run.drafted if draft_model else 0,
        verify_steps=steps,
        emitted_by_steps=run.decoded_tokens,
        draft_tokens_proposed=run.drafted,
        draft_tokens_accepted=run.accepted,
    )
