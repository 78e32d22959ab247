"""Chat conversations: OpenAI's message roles, message normalisation, and rendering a
conversation with a tokenizer's chat template into prompt token ids."""
from __future__ import annotations

from pagedllm.errors import InvalidParameterError, check_unicode

# Message roles of OpenAI's chat API.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")

# Names of transformers' apply_chat_template itself, or variables it sets for the
# template: a chat_template_kwargs key may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def normalize_chat_messages(messages) -> list[dict]:
    """Check a conversation and make each ``content`` a string (text parts joined; a
    content-less assistant message gets ``""``); other keys are kept.

    Raises:
        InvalidParameterError(param="messages"): not a non-empty list of objects, a bad
            role, missing/non-text content, or a lone UTF-16 surrogate.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidParameterError("messages", "messages must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise InvalidParameterError("messages", f"messages[{i}] must be an object")
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise InvalidParameterError("messages", f"messages[{i}].role must be one of "
                                                    f"{', '.join(CHAT_ROLES)}; got {role!r}")
        content = msg.get("content")
        if content is None:
            if role != "assistant":
                raise InvalidParameterError("messages", f"messages[{i}].content is required for a "
                                                        f"message with role '{role}'")
            content = ""
        elif isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise InvalidParameterError("messages", f"messages[{i}].content: only text content parts "
                                                        '({"type": "text", "text": ...}) are supported')
            content = "".join(p["text"] for p in content)
        elif not isinstance(content, str):
            raise InvalidParameterError("messages", f"messages[{i}].content must be a string or an array "
                                                    f"of text parts, got {type(content).__name__}")
        check_unicode("messages", content)
        out.append({**msg, "content": content})
    return out


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        chat_template: str | None = None, chat_template_kwargs: dict | None = None,
                        tools: list[dict] | None = None) -> list[int]:
    """Prompt token ids of a conversation rendered with the chat template (no added
    special tokens). ``chat_template_kwargs`` as vLLM's; ``tools`` go to the template's
    ``tools`` variable. ``tokenizer`` must not be used by another thread meanwhile.

    Raises:
        ValueError: the tokenizer has no chat template and none is given, or it fails to
            render.
        InvalidParameterError: malformed ``messages`` (see normalize_chat_messages); an empty
            (or non-string) ``chat_template``; ``chat_template_kwargs`` is not an object with
            string keys, sets a name in RESERVED_TEMPLATE_KWARGS, or names an argument the
            renderer rejects.
    """
    messages = normalize_chat_messages(messages)
    if not isinstance(chat_template_kwargs, (dict, type(None))) or not all(
            isinstance(k, str) for k in chat_template_kwargs or {}):
        raise InvalidParameterError("chat_template_kwargs", "chat_template_kwargs must be an object "
                                                            "with string keys")
    extra = dict(chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & extra.keys())
    if reserved:
        raise InvalidParameterError("chat_template_kwargs",
                                    f"chat_template_kwargs may not set {', '.join(reserved)}")
    if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
        raise InvalidParameterError("chat_template", "chat_template must be a non-empty Jinja template")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use the completions endpoint")
    try:
        if tools:
            extra["tools"] = tools
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, chat_template=chat_template, **extra)
    except TypeError as e:   # e.g. a chat_template_kwargs key the renderer takes itself
        if extra:
            raise InvalidParameterError("chat_template_kwargs",
                                        f"cannot apply the chat template with chat_template_kwargs: {e}") from e
        raise ValueError(f"cannot apply the chat template: {e}") from e
    except Exception as e:   # jinja2 syntax/undefined errors, a template's raise_exception
        raise ValueError(f"cannot apply the chat template: {e}") from e
    return tokenizer.encode(text, add_special_tokens=False)
