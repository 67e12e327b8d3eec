"""Chat templates rendered the way HF transformers renders them (`apply_chat_template`): the
checkpoint's Jinja template in an `ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True)` with the `loopcontrols` extension, the globals `raise_exception`,
`strftime_now`, a restricted `dict` and `namespace`, a `tojson` filter that leaves non-ASCII and
HTML characters alone, the `{% generation %}` tag, and the variables `messages`, `tools`,
`documents`, `add_generation_prompt` plus the named special tokens (`bos_token`, `eos_token`, ...).
Mirrors transformers/utils/chat_template_utils.py (transformers 5.x).

Templates come from checkpoints, so they are untrusted code: the sandbox refuses attribute
access to Python internals, and the messages are copied into plain JSON values first, so no
object with methods the sandbox does not know reaches the template.
"""

import functools
import json
from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# HF's chat convention; a template may know more (Llama 3.1's "ipython"), see `template_roles`.
STANDARD_ROLES = ("system", "user", "assistant", "tool")
_EXAMPLE = "[{'role': 'user', 'content': 'Hi!'}]"


class _Raised(jinja2.exceptions.TemplateError):
    """The template's own `raise_exception(message)`: it refuses the conversation."""


def _raise_exception(message: str) -> None:
    raise _Raised(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the rendered prompt.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Dict:
    """The `dict` a template sees: builds dicts, but is not the type (no `dict.__subclasses__`)."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace`, refusing underscore names (a way towards Python internals)."""

    def __init__(*args, **kwargs):
        # Jinja's own signature trick, so that `namespace(self=...)` still works.
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a namespace attribute may not start with an underscore (got {name!r})"
            )


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for transformers' assistant
    masks; rendering keeps its body as it is."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached by its text); a clear error if it is not valid Jinja."""
    try:
        return _environment().from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(
            f"the chat template is not valid Jinja (line {e.lineno}: {e.message}); fix it, or "
            "pass another with zoo.load_tokenizer(path, chat_template='file.jinja')"
        ) from e


def _is_role(node: nodes.Node) -> bool:
    """`message['role']`, `message.role` or a variable named `role`."""
    if isinstance(node, nodes.Getattr):
        return node.attr == "role"
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "role"
    return isinstance(node, nodes.Name) and node.name == "role"


def _strings(node: nodes.Node) -> set[str]:
    """The string constants `node` is, or lists (`'a'`, `['a', 'b']`, `('a', 'b')`)."""
    if isinstance(node, nodes.Const) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, nodes.List | nodes.Tuple):
        return {s for item in node.items for s in _strings(item)}
    return set()


@functools.lru_cache(maxsize=16)
def template_roles(source: str) -> tuple[str, ...]:
    """The roles a message may have with this template: HF's standard four, then every other role
    the template compares a message's role with (`message['role'] == 'ipython'`)."""
    compile_template(source)  # a syntax error reads better from there
    named: set[str] = set()
    for compare in _environment().parse(source).find_all(nodes.Compare):
        operands = [compare.expr, *(op.expr for op in compare.ops)]
        if any(_is_role(node) for node in operands):
            named |= {s for node in operands for s in _strings(node)}
    return STANDARD_ROLES + tuple(sorted(named - set(STANDARD_ROLES)))


def _plain(value: Any, where: str) -> Any:
    """`value` rebuilt from exact JSON types (subclasses and their methods stay outside)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # Subclasses (str enums, IntEnum) carry methods of their own: keep only the builtin value.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise TypeError(f"{where} has a key {key!r} that is not a string")
        return {str(k): _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise TypeError(
        f"{where} is a {type(value).__name__}; a chat template only sees JSON values "
        "(str, int, float, bool, None, lists and dicts of them)"
    )


def check_messages(messages: Any, roles: Collection[str]) -> list[dict[str, Any]]:
    """The messages as plain dicts, after HF's normalisation (keys whose value is None are
    dropped); a clear error for anything that is not a list of `{'role': ..., 'content': str}`
    dicts with a role in `roles`."""
    if not isinstance(messages, list | tuple):
        raise TypeError(
            f"messages must be a list of dicts like {_EXAMPLE}, not a {type(messages).__name__}"
        )
    if not messages:
        raise ValueError(f"messages is empty; a chat needs at least one message, like {_EXAMPLE}")
    checked = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise TypeError(
                f"{where} is a {type(message).__name__}, not a dict; messages must be a list of "
                f"dicts like {_EXAMPLE}"
            )
        message = {k: v for k, v in message.items() if v is not None}
        role = message.get("role")
        if role not in roles:
            raise ValueError(
                f"{where} has role {role!r}; this chat template takes the roles "
                f"{', '.join(map(repr, roles))}"
            )
        if "content" not in message:
            raise ValueError(f"{where} ({role}) has no 'content': give its text as a string")
        if not isinstance(message["content"], str):
            raise TypeError(
                f"{where} ({role}) has content of type {type(message['content']).__name__}; "
                "content must be a string (multimodal content lists are not supported)"
            )
        checked.append(_plain(message, where))
    return checked


def render(
    source: str,
    messages: Any,
    *,
    add_generation_prompt: bool,
    variables: Mapping[str, Any],
) -> str:
    """The text of `messages` in the chat template `source`, as transformers renders it
    (`apply_chat_template(..., tokenize=False)`). `variables` are the named special tokens and the
    caller's extra template variables (HF's `**kwargs`, e.g. `tools` or `enable_thinking`)."""
    template = compile_template(source)
    context = {
        "tools": None,
        "documents": None,
        **{name: _plain(value, name) for name, value in variables.items()},
        "messages": check_messages(messages, template_roles(source)),
        "add_generation_prompt": bool(add_generation_prompt),
    }
    try:
        return template.render(**context)
    except _Raised as e:
        raise ValueError(f"the chat template refuses these messages: {e.message}") from e
    except jinja2.exceptions.SecurityError as e:
        raise ValueError(
            f"the chat template tried to reach Python internals, which the sandbox refuses "
            f"({e}); do not use this template, or pass a safe one with "
            "zoo.load_tokenizer(path, chat_template='file.jinja')"
        ) from e
    except jinja2.exceptions.UndefinedError as e:
        raise ValueError(
            f"the chat template reads something these messages do not have ({e.message}); "
            "add it to the messages, or pass it as a template variable"
        ) from e
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"the chat template failed on these messages: {e}") from e


_PROBE = "Probe reply 7"


def turn_end(source: str, variables: Mapping[str, Any], special: Collection[str]) -> str | None:
    """The special token the template writes right after an assistant message's text (skipping
    whitespace): `<|im_end|>` for ChatML, `<|eot_id|>` for Llama 3, eos for Llama 2. Found by
    rendering the conversation user -> assistant; None if the template writes no special token
    there or refuses that conversation."""
    probe = [
        {"role": "user", "content": "Probe question"},
        {"role": "assistant", "content": _PROBE},
    ]
    try:
        text = render(source, probe, add_generation_prompt=False, variables=variables)
    except ValueError:
        return None
    at = text.rfind(_PROBE)
    if at < 0:
        return None
    after = text[at + len(_PROBE) :].lstrip()
    return next((t for t in sorted(special, key=len, reverse=True) if after.startswith(t)), None)
