import pytest

from miles.model.tokenizer import ByteTokenizer, load_tokenizer


@pytest.mark.parametrize("text", ["", "rev abc=", "héllo wörld ✓", "tabs\tand\nnewlines", "<not special>"])
def test_byte_tokenizer_round_trips_any_text(text):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_in_text_become_single_ids_and_can_be_skipped():
    tok = ByteTokenizer()
    ids = tok.encode("a<eos>b")
    assert ids == [97, tok.eos_token_id, 98]
    assert tok.decode(ids) == "ab" and tok.decode(ids, skip_special_tokens=False) == "a<eos>b"


def test_chat_template_marks_roles_and_opens_the_assistant_turn():
    tok = ByteTokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.im_end_id in tok.stop_token_ids


def test_token_text_gives_one_display_string_per_token():
    tok = ByteTokenizer()
    ids = tok.encode("a\x01<eos>")
    assert tok.token_text(ids) == ["a", "\\x01", "<eos>"]


def test_unknown_tokenizer_spec_is_an_error():
    with pytest.raises(ValueError, match="use 'bytes' or 'hf:"):
        load_tokenizer("sentencepiece")
