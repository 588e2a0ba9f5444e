"""A tokenizer's chat template, rendered as transformers renders it, and which tokens of a conversation are the
assistant's.

The template is the tokenizer's own (`chat_template` in tokenizer_config.json, or the `chat_template.jinja` that
transformers 5 saves beside it) unless `chat_template_path` names a file. It is rendered with jinja2 in a sandbox
under transformers' settings (trim_blocks, lstrip_blocks, loop controls, a `tojson` that keeps non-ASCII text,
`raise_exception`, `strftime_now`), given the messages, `add_generation_prompt` and the tokenizer's special tokens
(bos_token, eos_token, ...), and tokenized whole without added special tokens: the ids transformers'
`apply_chat_template(..., tokenize=True)` gives.

Which tokens are the assistant's: a template with `{% generation %}...{% endgeneration %}` blocks marks them
itself (what `return_assistant_tokens_mask=True` reads): every token overlapping a block's characters. A template
without them is rendered once per assistant turn on the conversation up to the turn before it, with the generation
prompt, and up to that turn: what the second adds to the first is the turn's own text (its content and its
end-of-turn markup). That needs a template that renders earlier turns the same whatever follows them; one that does
not (e.g. dropping earlier turns' reasoning) is refused, naming the turn, with the advice to add generation blocks.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from maxpar.core import storage
from maxpar.core.config import ConfigError

# Noncharacters (never interchanged as text) that a generation block's output is wrapped in while rendering, so its
# characters can be found in the rendered text afterwards.
_OPEN, _CLOSE = "\ufdd0", "\ufdd1"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TemplateError(ConfigError):
    """No template, a conversation it cannot render, or a template the assistant tokens cannot be found with."""


@dataclasses.dataclass(frozen=True)
class Rendered:
    """A rendered conversation and the character spans [start, end) of its assistant turns."""

    text: str
    spans: tuple[tuple[int, int], ...]


def _environment() -> Any:
    """A sandboxed jinja2 environment with transformers' settings and a `generation` tag that marks its output."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationMarks(jinja2.ext.Extension):
        """`{% generation %}body{% endgeneration %}` renders body between the two marks."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            return f"{_OPEN}{caller()}{_CLOSE}"

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationMarks, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the special-token strings it is rendered with."""

    source: str
    special_tokens: Mapping[str, str]
    where: str  # where it came from, for messages

    @property
    def marks_generation(self) -> bool:
        return bool(_GENERATION_TAG.search(self.source))

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False) -> Rendered:
        """The conversation as text, with the spans of the generation blocks' output (none without them)."""
        import jinja2

        chat = [{key: value for key, value in message.items() if value is not None} for message in messages]
        try:
            marked = _compiled(self.source).render(messages=chat, add_generation_prompt=add_generation_prompt,
                                                   tools=None, documents=None, **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(f"the chat template ({self.where}) cannot render it: {e}") from None
        return _unmark(marked)

    def assistant_spans(self, messages: Sequence[Mapping[str, Any]]) -> Rendered:
        """The whole conversation rendered, with the character spans of its assistant turns."""
        whole = self.render(messages)
        if self.marks_generation:
            return whole
        spans = []
        for turn, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self.render(messages[:turn], add_generation_prompt=True).text
            through = self.render(messages[:turn + 1]).text
            if not (through.startswith(before) and whole.text.startswith(through)):
                raise TemplateError(f"the chat template ({self.where}) renders the conversation before assistant "
                                    f"turn {turn} differently once that turn (or a later one) follows, so the "
                                    f"turn's tokens cannot be told apart; add {{% generation %}} ... "
                                    f"{{% endgeneration %}} around the assistant content in the template")
            spans.append((len(before), len(through)))
        return Rendered(whole.text, tuple(spans))


_COMPILED: dict[str, Any] = {}


def _compiled(source: str) -> Any:
    if source not in _COMPILED:
        _COMPILED[source] = _environment().from_string(source)
    return _COMPILED[source]


def _unmark(marked: str) -> Rendered:
    """The text without the generation marks, and the spans they enclosed."""
    text, spans, start = [], [], None
    length = 0
    for piece in re.split(f"([{_OPEN}{_CLOSE}])", marked):
        if piece == _OPEN:
            start = length
        elif piece == _CLOSE:
            spans.append((start, length))
        else:
            text.append(piece)
            length += len(piece)
    return Rendered("".join(text), tuple(spans))


def token_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for every token whose characters [start, end) overlap a span, else 0 (spans and tokens in order)."""
    mask = [0] * len(offsets)
    span = 0
    for index, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:
            mask[index] = 1
    return mask


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The special-token strings of a tokenizer_config.json (an AddedToken's content where it is one)."""
    tokens = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens


def _named_template(value: Any, where: str) -> str:
    """A tokenizer_config.json's chat_template: a string, or a list of {name, template} (the `default` one)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise TemplateError(f"{where}: chat_template is neither a string nor a list with a 'default' template")


def load_chat_template(tokenizer_path: str, template_path: str = "") -> ChatTemplate:
    """The chat template of a tokenizer (tokenizer_path: its tokenizer.json) or of `template_path`; TemplateError
    (naming the files looked at and the key to set) when there is none."""
    directory = storage.path(tokenizer_path).parent if tokenizer_path else None
    config_file = directory / "tokenizer_config.json" if directory else None
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file and config_file.is_file() else {}
    special = _special_tokens(config)
    if template_path:
        path = storage.path(template_path)
        if not path.is_file():
            raise TemplateError(f"chat_template_path={template_path!r}: no such file")
        return ChatTemplate(path.read_text(encoding="utf-8"), special, template_path)
    if "chat_template" in config:
        return ChatTemplate(_named_template(config["chat_template"], str(config_file)), special, str(config_file))
    jinja_file = directory / "chat_template.jinja" if directory else None
    if jinja_file and jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(encoding="utf-8"), special, str(jinja_file))
    looked = (f"{config_file} has no chat_template and there is no {jinja_file}" if directory else
              "tokenizer_path='' (the byte tokenizer) has no chat template")
    raise TemplateError(f"{looked}; set chat_template_path to a Jinja chat template file")
