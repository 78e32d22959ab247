"""``--chat-template`` / ``EngineArgs(chat_template=...)``: a template (inline or in a file)
that every chat rendering uses instead of the model's, checked before the model loads."""
from __future__ import annotations

import httpx
import pytest
from server_helpers import _Server

from pagedllm.config import EngineArgs, load_chat_template
from pagedllm.errors import InvalidParameterError

TEMPLATE = "{% for m in messages %}<<{{ m.role }}:{{ m.content }}>>{% endfor %}{% if add_generation_prompt %}=>{% endif %}"


def test_inline_and_file_templates_load(tmp_path):
    assert load_chat_template(TEMPLATE) == TEMPLATE
    # what HF templates use beyond plain Jinja: loop controls, the {% generation %} tag
    for t in ("{% for m in messages %}{{ m.content }}{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}",
              "{% for m in messages %}{% if m.role == 'user' %}{% continue %}{% endif %}{{ m.content }}{% endfor %}",
              "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"):
        assert load_chat_template(t) == t
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE, encoding="utf-8")
    assert load_chat_template(str(f)) == TEMPLATE


@pytest.mark.parametrize("value, says", [
    ("/no/such/template.jinja", "neither a file nor a Jinja template"),
    ("{% for m in messages %}", "not a valid Jinja template"),
    ("{{ m.content ", "not a valid Jinja template"),
])
def test_bad_templates_are_errors_naming_chat_template(value, says):
    with pytest.raises(InvalidParameterError) as e:
        EngineArgs(chat_template=value).validate()
    assert e.value.param == "chat_template" and says in str(e.value)


def test_the_server_renders_every_chat_with_it():
    server = _Server(engine_kw={"chat_template": TEMPLATE})
    try:
        tok = server.engine.tokenizer
        messages = [{"role": "user", "content": "hi"}]
        r = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == tok.encode("<<user:hi>>=>", add_special_tokens=False)
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 3,
                                                                  "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(tok.encode("<<user:hi>>=>", add_special_tokens=False))
    finally:
        server.stop()
