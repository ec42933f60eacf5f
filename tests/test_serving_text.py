"""Text in and out: the tokenizer, chat template and EOS ids ``make-checkpoint`` writes, and the incremental
detokenizer that finds stop strings and holds back what may still change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.engine.tokenizer_files import write_tokenizer
from kvtier.serving.text import Detokenizer, TemplateError, TextCodec


@pytest.fixture(scope="module")
def codec(checkpoint: Path) -> TextCodec:
    return TextCodec(checkpoint)


def test_the_tiny_checkpoint_has_a_tokenizer_of_its_vocabulary_and_its_eos_tokens(codec: TextCodec) -> None:
    assert codec.tokenizer.get_vocab_size() == 512
    assert codec.eos_token_ids == {2, 4}  # <|eos|> and the chat's <|im_end|>
    text = "The store keeps prefix blocks, erasure coded: 10 + 2 shards. ünïcode ✓"
    assert codec.decode(codec.encode(text)) == text


@pytest.mark.parametrize("vocab", [2048, 40_000])
def test_a_vocabulary_past_what_the_corpus_supports_is_filled_with_reserved_tokens(tmp_path: Path, vocab: int) -> None:
    write_tokenizer(tmp_path, vocab)
    assert TextCodec(tmp_path).tokenizer.get_vocab_size() == vocab


def test_the_chat_template_renders_as_transformers_would(codec: TextCodec) -> None:
    text = codec.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert codec.encode("<|im_start|>")[0] == 3


def test_a_checkpoint_without_a_template_refuses_chats_in_one_line(tmp_path: Path) -> None:
    write_tokenizer(tmp_path, 512)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TemplateError, match="no chat template"):
        TextCodec(tmp_path).render_chat([{"role": "user", "content": "hi"}])


def test_a_directory_without_a_tokenizer_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        TextCodec(tmp_path)


def stream(codec: TextCodec, text: str, stops: list[str]) -> tuple[list[str], Detokenizer]:
    detok = Detokenizer(codec, stops)
    out = [detok.add(t) for t in codec.encode(text)]
    return out, detok


def test_deltas_add_up_to_the_text_and_a_stop_string_ends_it_before_the_stop(codec: TextCodec) -> None:
    text = "alpha beta gamma delta"
    deltas, detok = stream(codec, text, [])
    assert "".join(deltas) + detok.flush() == text
    deltas, detok = stream(codec, text, [" gam"])
    assert "".join(deltas) + detok.flush() == "alpha beta" and detok.stopped


def test_a_possible_start_of_a_stop_string_is_held_back_until_it_is_not(codec: TextCodec) -> None:
    detok = Detokenizer(codec, ["END"])
    given = "".join(detok.add(t) for t in codec.encode("value E"))
    assert given == "value "  # "E" may begin "END"
    given += "".join(detok.add(t) for t in codec.encode("X"))
    assert given == "value EX"


def test_a_split_multibyte_character_is_held_back_until_it_is_whole(codec: TextCodec) -> None:
    ids = codec.encode("✓")
    assert len(ids) > 1  # the tiny vocabulary splits it into bytes
    detok = Detokenizer(codec, [])
    assert [detok.add(t) for t in ids] == [""] * (len(ids) - 1) + ["✓"]
