"""IncrementalDetokenizer: streamed text equals the tokenizer's own decode, and stop strings
split across tokens are never streamed (uses the bundled model's tokenizer, no weights)."""
from __future__ import annotations

import pytest

from pagedllm.engine.detokenizer import IncrementalDetokenizer

KOREAN = "안녕하세요, 세계! 오늘 날씨가 정말 좋네요. 한국어 텍스트를 스트리밍합니다."
EMOJI = "I love pizza 🍕🍕 and the 👩‍👩‍👧‍👦 family emoji 🎉! Ünïcödé ñ 日本語 too."


def stream(tokenizer, ids, stop=(), include_stop=False, skip_special=True):
    """Feed ``ids`` one token at a time the way LLMEngine does; returns
    (deltas streamed while running, final delta, matched stop string, detokenizer)."""
    d = IncrementalDetokenizer(tokenizer, list(stop), include_stop, skip_special)
    deltas = []
    for t in ids:
        matched = d.update([t])
        if matched is not None:
            return deltas, d.delta(True), matched, d
        deltas.append(d.delta(False))
    return deltas, d.delta(True), None, d


@pytest.mark.parametrize("text", [KOREAN, EMOJI, KOREAN + " " + EMOJI, "plain ascii text, with  double spaces and\nnew lines\t tabs."])
def test_deltas_concatenate_to_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 5
    deltas, last, matched, d = stream(tokenizer, ids)
    assert matched is None
    full = "".join(deltas) + last
    assert full == tokenizer.decode(ids) == text
    assert d.text == text
    # No delta ever holds a broken character.
    assert all("\ufffd" not in x for x in deltas + [last])


def test_multibyte_characters_wait_for_their_last_byte(tokenizer):
    ids = tokenizer.encode(KOREAN, add_special_tokens=False)
    # Korean syllables are 3 UTF-8 bytes spread over several byte-level tokens: some
    # steps must produce nothing rather than a replacement character.
    deltas, _, _, _ = stream(tokenizer, ids)
    assert deltas.count("") > 0
    assert len(ids) > len(KOREAN.replace(" ", ""))


@pytest.mark.parametrize("skip_special", [True, False])
def test_special_tokens(tokenizer, skip_special):
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = ([im_start] + tokenizer.encode("assistant\n안녕 🎉 hi", add_special_tokens=False)
           + [im_end])
    deltas, last, _, _ = stream(tokenizer, ids, skip_special=skip_special)
    assert "".join(deltas) + last == tokenizer.decode(ids, skip_special_tokens=skip_special)
    assert ("<|im_end|>" in "".join(deltas) + last) == (not skip_special)


STOP_TEXT = "The answer is: STOP_HERE and more text after it"


def test_stop_string_split_across_tokens_is_never_emitted(tokenizer):
    ids = tokenizer.encode(STOP_TEXT, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "STOP_HERE" not in pieces and sum("STOP_HERE".find(p.strip()) >= 0 for p in pieces) >= 3, \
        "the stop string must be split over several tokens for this test"
    deltas, last, matched, d = stream(tokenizer, ids, stop=["STOP_HERE"])
    assert matched == "STOP_HERE"
    streamed = "".join(deltas)
    expected = "The answer is: "
    # While running, nothing of the stop string leaked out; at the end the text stops there.
    assert expected.startswith(streamed)
    assert not any(c in streamed[len("The answer is:"):] for c in "STOP_HERE")
    assert streamed + last == expected == d.text
    # The stop was recognised at the token that completed it, not later.
    n = len(deltas) + 1
    assert "STOP_HERE" in tokenizer.decode(ids[:n]) and "STOP_HERE" not in tokenizer.decode(ids[:n - 1])


def test_stop_string_included_when_asked(tokenizer):
    ids = tokenizer.encode(STOP_TEXT, add_special_tokens=False)
    deltas, last, matched, d = stream(tokenizer, ids, stop=["STOP_HERE"], include_stop=True)
    assert matched == "STOP_HERE"
    assert "".join(deltas) + last == "The answer is: STOP_HERE" == d.text
    assert "STOP_HERE" not in "".join(deltas)


def test_earliest_stop_string_wins(tokenizer):
    ids = tokenizer.encode(STOP_TEXT, add_special_tokens=False)
    deltas, last, matched, d = stream(tokenizer, ids, stop=["and more", "P_H", "zzz"])
    assert matched == "P_H"
    assert "".join(deltas) + last == "The answer is: STO"


def test_near_miss_of_a_stop_string_is_released_in_full(tokenizer):
    # "STOP_THERE" shares a prefix with the stop string: held back while it could still
    # match, then streamed once it cannot; nothing is lost or duplicated.
    text = "The answer is: STOP_THERE and then STOP_HER is not it either"
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, last, matched, _ = stream(tokenizer, ids, stop=["STOP_HERE"])
    assert matched is None
    assert "".join(deltas) + last == text
    # While running, at most len(stop) - 1 characters are held back.
    d = IncrementalDetokenizer(tokenizer, ["STOP_HERE"])
    sent = ""
    for t in ids:
        d.update([t])
        sent += d.delta(False)
        assert len(d.text) - len(sent) <= len("STOP_HERE") - 1


def test_stop_string_in_korean_text(tokenizer):
    ids = tokenizer.encode(KOREAN, add_special_tokens=False)
    deltas, last, matched, _ = stream(tokenizer, ids, stop=["날씨"])
    assert matched == "날씨"
    assert "".join(deltas) + last == KOREAN[: KOREAN.index("날씨")]
    assert all("\ufffd" not in x for x in deltas)


def test_stop_string_in_the_first_token(tokenizer):
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    deltas, last, matched, d = stream(tokenizer, ids, stop=["Hello"])
    assert (deltas, last, matched, d.text) == ([], "", "Hello", "")


def test_stop_strings_wait_for_min_tokens(tokenizer):
    """As vLLM: a stop string completed before min_tokens tokens exist does not end the
    request; one completed after it does."""
    text = "Paris. Rome. Berlin. Madrid."
    ids = tokenizer.encode(text, add_special_tokens=False)
    _, _, matched, d = stream(tokenizer, ids, stop=["."])
    assert (matched, d.text) == (".", "Paris")
    first_dot = next(i for i in range(len(ids)) if "." in tokenizer.decode(ids[: i + 1]))
    d = IncrementalDetokenizer(tokenizer, ["."], min_tokens=first_dot + 2)
    matched = None
    for t in ids:
        matched = d.update([t])
        if matched is not None:
            break
    assert matched == "." and d.num_tokens >= first_dot + 2
    assert d.text.startswith("Paris.") and d.text.count(".") == 1


def _feed(d, chunks, stop_terminated_last=True):
    """Feed ``chunks`` (lists of ids) as LLMEngine does, the last one ending the request as an
    EOS / stop token id would; returns (deltas while running, final delta, matched)."""
    deltas = []
    matched = None
    for k, chunk in enumerate(chunks):
        last = k == len(chunks) - 1
        matched = d.update(chunk, stop_terminated=last and stop_terminated_last)
        if matched is not None or last:
            return deltas, d.delta(True), matched
        deltas.append(d.delta(False))
    return deltas, d.delta(True), matched


@pytest.mark.parametrize("chunked", [False, True], ids=["one-per-step", "speculative-chunk"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_only_with_include_stop_str(tokenizer, chunked, include):
    """As vLLM: the EOS / stop token id that ended a request stays in the token ids, but its
    text is in neither the text nor any streamed delta unless include_stop_str_in_output.
    With speculative decoding it arrives as the last of several tokens of one step."""
    ids = tokenizer.encode(" Paris.\n\nThe United", add_special_tokens=False)
    assert ids[-1] == 1797 and tokenizer.decode([1797]) == " United"
    chunks = [ids[:2], ids[2:]] if chunked else [[t] for t in ids]
    d = IncrementalDetokenizer(tokenizer, ["zzz"], include)
    deltas, last, matched = _feed(d, chunks)
    want = " Paris.\n\nThe United" if include else " Paris.\n\nThe"
    assert matched is None
    assert (d.text, "".join(deltas) + last) == (want, want)
    assert d.num_tokens == len(ids)


@pytest.mark.parametrize("include", [False, True])
def test_eos_text_left_out_with_special_tokens_kept(tokenizer, include):
    """skip_special_tokens=False keeps special tokens inside the text, but the EOS that
    ended the request is not part of it (unless include_stop_str_in_output)."""
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = [im_start] + tokenizer.encode("assistant\nHello!", add_special_tokens=False) + [im_end]
    d = IncrementalDetokenizer(tokenizer, [], include, skip_special_tokens=False)
    deltas, last, _ = _feed(d, [[t] for t in ids])
    want = "<|im_start|>assistant\nHello!" + ("<|im_end|>" if include else "")
    assert (d.text, "".join(deltas) + last) == (want, want)


def test_stop_string_before_the_stop_token_in_one_chunk(tokenizer):
    """A stop string completed by an earlier token of the chunk wins over the stop token."""
    ids = tokenizer.encode(" Paris.\n\nThe United", add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, ["."], include_stop_str_in_output=True)
    assert d.update(ids, stop_terminated=True) == "."
    assert d.text == " Paris."
