"""Chat templates: a conversation rendered as Hugging Face renders it, and where its answers are.

A chat model's tokenizer carries a Jinja template that turns a list of messages into the one
string the model reads (`PreTrainedTokenizerBase.apply_chat_template`, see
https://huggingface.co/docs/transformers/chat_templating). It is rendered here the same way:
a sandboxed environment (`ImmutableSandboxedEnvironment`; templates from a model hub are
untrusted code) with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a
`tojson` filter that does not escape HTML, `raise_exception`, the tokenizer's special tokens
(`bos_token`, `eos_token`, ...) and `add_generation_prompt`. Transformers' `strftime_now` is
left out on purpose: a template that stamps today's date would make the cached data depend on
the day it was built (templates that use it test `strftime_now is defined` and fall back).

Where the answers are, as character spans of the rendered text:

- A template that marks them with `{% generation %} ... {% endgeneration %}` says so itself;
  the spans are what those blocks rendered (transformers' `return_assistant_tokens_mask`).
- Otherwise incrementally: for the assistant message i, the text of messages[:i] with the
  generation prompt is a prefix of the text of messages[:i + 1], and what follows it is the
  answer with the template's end of turn (`Hi<|eot_id|>`). Whitespace after the end of turn
  (ChatML's newline after `<|im_end|>`) is left out: it is formatting, not the answer. A
  template whose renderings are not prefixes of one another (one that rewrites earlier turns)
  is refused with a hint to mark the answers.

A token is learnt when its character offsets overlap an answer span (transformers maps the
first and last character of each span with `char_to_token`, the same tokens).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hyperloom.data.errors import DataError

logger = logging.getLogger("hyperloom.data")

Message = dict[str, Any]
Span = tuple[int, int]  # [start, end) characters of the rendered text

# The built-in byte-level BPE has no chat template, and eos is its only special token:
# `<|role|>\n{content}{eos}` per message, the Zephyr format (HuggingFaceH4/zephyr-7b-beta)
# without its newline after eos, so a conversation ends with eos and needs no separator.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


class _AnswerTracker(Extension):
    """`{% generation %}...{% endgeneration %}`: records the span each block renders to."""

    tags = {"generation"}

    def __init__(self, environment: jinja2.Environment) -> None:
        super().__init__(environment)
        self.pieces: list[str] | None = None  # the output so far, while tracking
        self.spans: list[Span] = []

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller: Any) -> str:
        text = caller()
        if self.pieces is not None and text:
            start = sum(map(len, self.pieces))
            self.spans.append((start, start + len(text)))
        return text


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class ChatTemplate:
    """A compiled chat template with the special tokens it is rendered with."""

    def __init__(self, source: str, specials: dict[str, str], origin: str) -> None:
        self.source = source
        self.specials = dict(specials)
        self.origin = origin  # where it came from, for messages and run info
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_AnswerTracker, loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise DataError(
                f"the chat template ({origin}) is not valid Jinja: {exc.message} (line {exc.lineno})"
            ) from None
        self._tracker: _AnswerTracker = env.extensions[_AnswerTracker.identifier]  # type: ignore[assignment]
        # transformers' test for a template that marks its answers
        self.marks_answers = re.search(r"\{%-?\s*generation\s*-?%\}", source) is not None

    @property
    def identity(self) -> str:
        """A digest of everything that decides the rendered text (for cache keys)."""
        blob = json.dumps([self.source, self.specials], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def _context(self, messages: Sequence[Message], add_generation_prompt: bool) -> dict:
        return {
            **self.specials,
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
        }

    def render(
        self, messages: Sequence[Message], add_generation_prompt: bool = False, where: str = ""
    ) -> str:
        """The conversation as text; DataError (naming `where`) if the template fails on it."""
        return self._generate(messages, add_generation_prompt, where)[0]

    def _generate(
        self, messages: Sequence[Message], add_generation_prompt: bool, where: str
    ) -> tuple[str, list[Span]]:
        pieces: list[str] = []
        self._tracker.pieces, self._tracker.spans = pieces, []
        try:
            # Piece by piece, so that a generation block sees the output before it.
            for piece in self._template.generate(**self._context(messages, add_generation_prompt)):
                pieces.append(piece)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            reason = exc.message if isinstance(exc, jinja2.TemplateError) else repr(exc)
            raise DataError(
                f"{where or 'a conversation'}: the chat template ({self.origin}) failed on it: "
                f"{reason}"
            ) from None
        finally:
            spans, self._tracker.pieces = self._tracker.spans, None
        return "".join(pieces), spans

    def render_answers(self, messages: Sequence[Message], where: str) -> tuple[str, list[Span]]:
        """The whole conversation's text and the character spans of its assistant answers."""
        text, marked = self._generate(messages, False, where)
        if self.marks_answers:
            return text, marked
        spans: list[Span] = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            prompt = self.render(messages[:i], True, where)
            upto = self.render(messages[: i + 1], False, where)
            if not (upto.startswith(prompt) and text.startswith(upto)):
                raise DataError(
                    f"{where}: the chat template ({self.origin}) does not render the "
                    f"conversation up to assistant message {i + 1} as a prefix of the whole, so "
                    "its answer cannot be located; mark the answers in the template with "
                    "{% generation %} ... {% endgeneration %} (data.chat_template)"
                )
            end = len(upto.rstrip())
            if end > len(prompt):
                spans.append((len(prompt), end))
        return text, spans


def token_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[Span]) -> np.ndarray:
    """(tokens,) bool: the tokens whose [start, end) character offsets overlap a span."""
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)  # (tokens, 2)
    mask = np.zeros(len(off), dtype=bool)
    for start, end in spans:
        mask |= (off[:, 0] < end) & (off[:, 1] > start)
    return mask


def _special(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _config_template(config: dict, where: str) -> str | None:
    """tokenizer_config.json's `chat_template`: a string, or a list of named templates."""
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise DataError(
            f"{where} has named chat templates {sorted(map(str, named))} but none named "
            "'default'; give the one to train with as data.chat_template (a .jinja file)"
        )
    raise DataError(f"{where}: chat_template is a {type(value).__name__}, expected a string")


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DataError(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None


def load_chat_template(
    template_file: str, tokenizer_path: str | Path | None, eos_token: str
) -> ChatTemplate:
    """The template to render with, first found of: `template_file` (data.chat_template), the
    tokenizer's `chat_template.jinja`, the `chat_template` of its `tokenizer_config.json`,
    `DEFAULT_TEMPLATE`. Special tokens come from that tokenizer_config.json; eos defaults to
    `eos_token` (data.eos_token)."""
    config: dict = {}
    folder = None
    if tokenizer_path:
        tok = Path(tokenizer_path).expanduser()
        folder = tok if tok.is_dir() else tok.parent
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                config = json.loads(_read(cfg_path, "the tokenizer config"))
            except ValueError as exc:
                raise DataError(f"{str(cfg_path)!r} is not valid JSON: {exc}") from None
            if not isinstance(config, dict):
                raise DataError(f"{str(cfg_path)!r} holds a JSON {type(config).__name__}")
    specials = {k: v for k in SPECIAL_TOKENS if (v := _special(config.get(k))) is not None}
    specials.setdefault("eos_token", eos_token)
    specials.setdefault("bos_token", "")
    if template_file:
        path = Path(template_file).expanduser()
        return ChatTemplate(_read(path, "the chat template"), specials, str(path))
    if folder is not None and (folder / "chat_template.jinja").is_file():
        path = folder / "chat_template.jinja"
        return ChatTemplate(_read(path, "the chat template"), specials, str(path))
    source = (
        _config_template(config, repr(str(folder / "tokenizer_config.json"))) if config else None
    )
    if source is not None:
        return ChatTemplate(source, specials, str(folder / "tokenizer_config.json"))
    if tokenizer_path:
        logger.info("the tokenizer has no chat template; using the built-in default")
    return ChatTemplate(DEFAULT_TEMPLATE, specials, "built-in default (Zephyr-like)")
