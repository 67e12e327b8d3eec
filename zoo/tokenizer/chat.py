"""Chat templates rendered the way HF transformers renders them (`apply_chat_template`): the
checkpoint's Jinja template in an `ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True)` with the `loopcontrols` extension, the globals `raise_exception`,
`strftime_now`, a restricted `dict` and `namespace`, a `tojson` filter that leaves non-ASCII and
HTML characters alone, the `{% generation %}` tag, and the variables `messages`, `tools`,
`documents`, `add_generation_prompt` plus the named special tokens (`bos_token`, `eos_token`, ...).
Mirrors transformers/utils/chat_template_utils.py (transformers 5.x).

Templates come from checkpoints, so they are untrusted code: the sandbox refuses attribute
access to Python internals, and the messages are copied into plain JSON values first, so no
object with methods the sandbox does not know reaches the template. A render is bounded
(`RenderLimits`, set for a block of code with `render_limits(...)`): its time, checked at every
loop iteration of the template's code (`sys.monitoring` jump events on the compiled template's
code objects) and every output chunk; its output's length; the template's length; and the size
of every string or list it builds with `*`, `+`, `~`, `**`, a filter or a method call (their
integer arguments and results). Past a bound, a ValueError names the bound and how to raise it.
"""

import contextlib
import contextvars
import dataclasses
import functools
import json
import math
import sys
import threading
import time
import warnings
from collections.abc import Collection, Iterator, Mapping
from datetime import datetime
from types import CodeType
from typing import Any, ClassVar

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class RenderLimits:
    """Bounds on rendering one untrusted chat template. Real templates render in milliseconds,
    with output a little longer than the messages; the defaults leave room for a conversation of
    a million tokens and a slow machine, and stop a template written to hang or to fill memory.

    `seconds`: wall-clock time of one render. `output_chars`: the rendered text's length, and
    the length of any one string or list the template builds. `template_chars`: the template's
    own length (the longest real ones are tens of thousands of characters)."""

    seconds: float = 10.0
    output_chars: int = 20_000_000
    template_chars: int = 1_000_000

    def __post_init__(self):
        if not (isinstance(self.seconds, int | float) and 0 < self.seconds < math.inf):
            raise ValueError(f"RenderLimits.seconds must be a positive number, got {self.seconds}")
        for name in ("output_chars", "template_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RenderLimits.{name} must be a positive int, got {value!r}")


_LIMITS: contextvars.ContextVar[RenderLimits] = contextvars.ContextVar(
    "chat_render_limits",
    default=RenderLimits(),  # noqa: B039 (frozen: never mutated)
)


@contextlib.contextmanager
def render_limits(limits: RenderLimits) -> Iterator[RenderLimits]:
    """Every render inside the block (through `Tokenizer.render_chat`, SFT data, the chat
    command) uses `limits`: `with render_limits(RenderLimits(seconds=60)): ...`."""
    if not isinstance(limits, RenderLimits):
        raise TypeError(f"render_limits takes a RenderLimits, not a {type(limits).__name__}")
    token = _LIMITS.set(limits)
    try:
        yield limits
    finally:
        _LIMITS.reset(token)


class _OverLimit(jinja2.exceptions.TemplateError):
    """A render went past one of its `RenderLimits`."""


# The render running on this thread: (deadline, limits), or None outside a render.
_RUNNING = threading.local()


def _budget() -> RenderLimits | None:
    """The running render's limits after checking its deadline; None outside a render."""
    running = getattr(_RUNNING, "render", None)
    if running is None:
        return None
    deadline, limits = running
    if time.monotonic() > deadline:
        raise _OverLimit(
            f"rendering took more than {limits.seconds} s (RenderLimits.seconds); the template "
            "loops too long for these messages"
        )
    return limits


_SIZED = (str, list, tuple)
_QUOTED = {op: f"'{op}'" for op in ("*", "+", "**")}


def _check_size(value: Any, what: str) -> Any:
    """`value`, unless it is a string or list longer than the running render allows."""
    if type(value) in _SIZED or isinstance(value, _SIZED):
        running = getattr(_RUNNING, "render", None)
        if running is not None and len(value) > running[1].output_chars:
            raise _OverLimit(
                f"{what} built a value of {len(value):,} items, more than "
                f"RenderLimits.output_chars={running[1].output_chars:,}"
            )
    return value


def _check_int_arguments(args: tuple, kwargs: dict, what: str) -> None:
    """Refuse an integer argument larger than the output allows (a width of `center`, a count
    of `*`): the value it would build is refused before it is built."""
    running = getattr(_RUNNING, "render", None)
    if running is None:
        return
    limit = running[1].output_chars
    for value in (*args, *kwargs.values()):
        if type(value) is int and abs(value) > limit:
            raise _OverLimit(
                f"{what} got the number {value:,}, more than RenderLimits.output_chars={limit:,}"
            )


def _bounded_filter(name: str, f):
    @functools.wraps(f)
    def bounded(*args, **kwargs):
        _check_int_arguments(args, kwargs, f"the filter {name}")
        return _check_size(f(*args, **kwargs), f"the filter {name}")

    return bounded


def _join(values) -> str:
    """Jinja's `~` (`str_join`), bounded."""
    return _check_size("".join(map(str, values)), "'~'")


class _BoundedCode(CodeGenerator):
    """Jinja's code generator with `a ~ b` calling the environment's bounded join, and output
    expressions evaluated when rendering, never folded into constants at compile time (where
    `{{ 'x'|center(10**9) }}` would run outside the limits)."""

    def _output_child_to_const(self, node: nodes.Expr, frame: Frame, finalize) -> str:
        if not isinstance(node, nodes.TemplateData | nodes.Const):
            raise nodes.Impossible()
        return super()._output_child_to_const(node, frame, finalize)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Sandbox(ImmutableSandboxedEnvironment):
    """The sandbox with the size of `*`, `+`, `**`, `~` and method calls bounded."""

    code_generator_class = _BoundedCode
    intercepted_binops = frozenset({"*", "+", "**"})
    bounded_join = staticmethod(_join)

    def call_binop(self, context, operator_: str, left, right):
        if operator_ == "*":
            counts = [x for x in (left, right) if isinstance(x, int)]
            sized = [x for x in (left, right) if isinstance(x, _SIZED)]
            if counts and sized:
                _check_int_arguments((len(sized[0]) * counts[0],), {}, "'*'")
        elif operator_ == "**" and isinstance(left, int) and isinstance(right, int):
            bits = abs(right) * max(abs(left), 1).bit_length()
            _check_int_arguments((bits // 4,), {}, "'**'")  # ~ digits of the power
        return _check_size(super().call_binop(context, operator_, left, right), _QUOTED[operator_])

    def call(__self, __context, __obj, *args, **kwargs):
        _check_int_arguments(args, kwargs, "a method call")
        result = super().call(__context, __obj, *args, **kwargs)
        return _check_size(result, "a method call")


# Loops that write nothing meet no output check: a jump event on every backward jump of the
# template's code checks the deadline. One sys.monitoring tool id, taken on first use.
_TOOL_NAME = "zoo chat template limits"


@functools.cache
def _monitoring_tool() -> int | None:
    monitoring = sys.monitoring
    for tool in (4, 3):  # ids 0-2 and 5 are the debugger's, coverage's, profilers', optimizers'
        if monitoring.get_tool(tool) in (None, _TOOL_NAME):
            if monitoring.get_tool(tool) is None:
                monitoring.use_tool_id(tool, _TOOL_NAME)
            monitoring.register_callback(tool, monitoring.events.JUMP, _on_jump)
            return tool
    warnings.warn(
        "no sys.monitoring tool id is free: a chat template's loops that write nothing are not "
        "time-bounded (output and sizes still are)",
        RuntimeWarning,
        stacklevel=3,
    )
    return None


def _on_jump(code: CodeType, source: int, destination: int) -> None:
    _budget()


def _code_objects(code: CodeType) -> Iterator[CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield from _code_objects(const)


def _watch(template: jinja2.Template) -> None:
    """Turn on the deadline check at every backward jump of `template`'s compiled code."""
    tool = _monitoring_tool()
    if tool is None:
        return
    functions = [template.root_render_func, *template.blocks.values()]
    for function in functions:
        for code in _code_objects(function.__code__):
            sys.monitoring.set_local_events(tool, code, sys.monitoring.events.JUMP)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    # optimized=False: Jinja's optimizer would run constant filters at compile time, outside
    # the render's limits.
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_Generation, jinja2.ext.loopcontrols],
        optimized=False,
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached by its text); a clear error if it is not valid Jinja or
    longer than `RenderLimits.template_chars`."""
    limit = _LIMITS.get().template_chars
    if len(source) > limit:
        raise ValueError(
            f"the chat template is {len(source):,} characters long, more than "
            f"RenderLimits.template_chars={limit:,} (real templates are tens of thousands); "
            "check where it came from, or raise the limit with "
            "zoo.tokenizer.chat.render_limits(RenderLimits(template_chars=...))"
        )
    try:
        template = _environment().from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(
            f"the chat template is not valid Jinja (line {e.lineno}: {e.message}); fix it, or "
            "pass another with zoo.load_tokenizer(path, chat_template='file.jinja')"
        ) from e
    _watch(template)
    return template


def _render_bounded(template: jinja2.Template, context: dict[str, Any]) -> str:
    """`template.render(**context)` within the current `RenderLimits`."""
    limits = _LIMITS.get()
    outer = getattr(_RUNNING, "render", None)
    _RUNNING.render = (time.monotonic() + limits.seconds, limits)
    chunks, length = [], 0
    try:
        for i, chunk in enumerate(template.generate(**context)):
            length += len(chunk)
            if length > limits.output_chars:
                raise _OverLimit(
                    f"the rendered text is longer than RenderLimits.output_chars="
                    f"{limits.output_chars:,}"
                )
            if i % 64 == 0:  # the clock is read far less often than a chunk comes
                _budget()
            chunks.append(chunk)
    finally:
        _RUNNING.render = outer
    return "".join(chunks)


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
        return _render_bounded(template, context)
    except _OverLimit as e:
        raise ValueError(
            f"the chat template went past its bounds: {e.message}; a template from an untrusted "
            "checkpoint may be written to hang: check it, or raise the limits with "
            "zoo.tokenizer.chat.render_limits(RenderLimits(...))"
        ) from e
    except RecursionError as e:
        raise ValueError("the chat template recurses without end (a macro calling itself)") from e
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
