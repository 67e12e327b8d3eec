"""The formats a dataset's rows may have, found from its columns, and each row as a conversation.

    text        a text column (--text-column, default `text`): plain documents, loss on every token
    chat        `messages`: a list of {"role": ..., "content": ...}; loss on the assistant turns
    completion  `prompt` and `completion` strings; loss on the completion
    alpaca      `instruction`, optional `input`, `output`; the user message is the instruction,
                then "\\n\\n" and the input when there is one; loss on the output
    preference  `chosen` and `rejected` responses (and usually a `prompt`): pairs for DPO and
                its variants, read by data/preference.py

`detect_format` picks the first of these whose columns the dataset has (`auto`), or checks the
one asked for. Every non-text row becomes a conversation (`row_messages`): a list of
`{"role", "content"}` dicts, a prompt/completion pair as one user and one assistant message.
A bad row is a ValueError naming its row number (1-based, in the file's order) and what to fix.
"""

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

Format = Literal["text", "chat", "completion", "alpaca", "preference"]
FORMATS: tuple[str, ...] = ("auto", "text", "chat", "completion", "alpaca", "preference")

# The columns each format needs (text: the --text-column); alpaca's `input` may be absent.
_NEEDS: dict[str, tuple[str, ...]] = {
    "chat": ("messages",),
    "completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "preference": ("chosen", "rejected"),
}


def _needs(data_format: str, text_column: str) -> tuple[str, ...]:
    return (text_column,) if data_format == "text" else _NEEDS[data_format]


def _formats_line(text_column: str) -> str:
    return "; ".join(
        f"{name}: {', '.join(map(repr, _needs(name, text_column)))}" for name in ("text", *_NEEDS)
    )


def detect_format(columns: Sequence[str], requested: str, text_column: str = "text") -> Format:
    """The format of a dataset with `columns`: `requested`, checked, or with `auto` the first of
    text, chat, completion, alpaca, preference whose columns are all there."""
    if requested not in FORMATS:
        raise ValueError(f"--data-format {requested!r} is not one of {list(FORMATS)}")
    candidates = ("text", *_NEEDS) if requested == "auto" else (requested,)
    for name in candidates:
        if all(column in columns for column in _needs(name, text_column)):
            return name
    wanted = "matches no format" if requested == "auto" else f"is not --data-format {requested}"
    raise ValueError(
        f"the dataset {wanted}: its columns are {list(columns)}; the formats and the columns "
        f"each needs are {_formats_line(text_column)} (alpaca's 'input' is optional). Rename "
        "the columns, or pass --text-column for text in another column"
    )


def _string(row: int, where: str, value: Any) -> str:
    if value is None:
        raise ValueError(f"row {row}: {where} is null (missing): give it a string, or drop the row")
    if not isinstance(value, str):
        raise ValueError(
            f"row {row}: {where} is {type(value).__name__} {value!r:.60}, not a string"
        )
    return value


def row_messages(
    row: Mapping[str, Any], data_format: Format, number: int, roles: Collection[str]
) -> list[dict[str, str]]:
    """Row `number` (1-based) of a chat, completion or alpaca dataset as a conversation; `roles`
    are those a message may have (the chat template's)."""
    if data_format == "completion":
        prompt = _string(number, "'prompt'", row["prompt"])
        completion = _string(number, "'completion'", row["completion"])
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    if data_format == "alpaca":
        user = _string(number, "'instruction'", row["instruction"])
        extra = row.get("input")
        if extra is not None and _string(number, "'input'", extra):
            user = f"{user}\n\n{extra}"
        output = _string(number, "'output'", row["output"])
        return [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"row {number}: 'messages' is {messages!r:.60}, not a non-empty list of "
            '{"role": ..., "content": ...} objects'
        )
    conversation = []
    for index, message in enumerate(messages):
        where = f"message {index}"
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError(
                f"row {number}: {where} is {message!r:.60}, not an object with 'role' and 'content'"
            )
        role = message["role"]
        if role not in roles:
            raise ValueError(
                f"row {number}: {where} has role {role!r}, which the chat template does not "
                f"know; the roles allowed are {list(roles)}"
            )
        content = _string(number, f"{where}'s 'content' ({role})", message.get("content"))
        conversation.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in conversation):
        raise ValueError(
            f"row {number} has no assistant message, so nothing to learn from: add the "
            "assistant's answer, or drop the row"
        )
    return conversation
