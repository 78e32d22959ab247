"""engine/chat.py over a tokenizer alone (the bundled model's, no weights): rendering, the
``tools`` variable, the reserved chat_template_kwargs, and a tokenizer without a template;
the names LLMEngine's module re-exports stay the same objects."""
from __future__ import annotations

import copy

import pytest

from pagedllm.engine import chat
from pagedllm.errors import InvalidParameterError

MSGS = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if tools %}[{{ tools | length }} tools]{% endif %}{% if shout %}!{% endif %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_renders_normalised_messages_and_tokenizes_without_special_tokens(tokenizer):
    ids = chat.apply_chat_template(tokenizer, MSGS, chat_template=TEMPLATE)
    text = "<system>Be brief.<user>Hi there<assistant>"
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    no_prompt = chat.apply_chat_template(tokenizer, MSGS, add_generation_prompt=False, chat_template=TEMPLATE)
    assert tokenizer.decode(no_prompt) == "<system>Be brief.<user>Hi there"


def test_model_template_matches_transformers(tokenizer):
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    want = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert chat.apply_chat_template(tokenizer, msgs) == tokenizer.encode(want, add_special_tokens=False)


def test_tools_and_kwargs_reach_the_template(tokenizer):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}] * 2
    ids = chat.apply_chat_template(tokenizer, MSGS, chat_template=TEMPLATE, chat_template_kwargs={"shout": True},
                                   tools=tools)
    assert tokenizer.decode(ids).endswith("there[2 tools]!<assistant>")


@pytest.mark.parametrize("kwargs, words", [
    ({"tokenize": True}, "may not set tokenize"),
    ({"messages": [], "tools": []}, "may not set messages, tools"),
    ([("shout", True)], "must be an object with string keys"),
    ({1: True}, "must be an object with string keys"),
])
def test_bad_chat_template_kwargs_name_the_parameter(tokenizer, kwargs, words):
    assert "tokenizer_kwargs" in chat.RESERVED_TEMPLATE_KWARGS
    with pytest.raises(InvalidParameterError, match=words) as e:
        chat.apply_chat_template(tokenizer, MSGS, chat_template=TEMPLATE, chat_template_kwargs=kwargs)
    assert e.value.param == "chat_template_kwargs"


def test_no_template_or_a_broken_one_is_a_value_error(tokenizer):
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        chat.apply_chat_template(bare, MSGS)
    with pytest.raises(ValueError, match="cannot apply the chat template"):
        chat.apply_chat_template(tokenizer, MSGS, chat_template="{% for %}")
    with pytest.raises(InvalidParameterError, match="role must be one of") as e:
        chat.apply_chat_template(tokenizer, [{"role": "robot", "content": "x"}], chat_template=TEMPLATE)
    assert e.value.param == "messages"


def test_llm_engine_re_exports_the_chat_names():
    from pagedllm.engine import llm_engine

    assert llm_engine.normalize_chat_messages is chat.normalize_chat_messages
    assert llm_engine.CHAT_ROLES is chat.CHAT_ROLES
