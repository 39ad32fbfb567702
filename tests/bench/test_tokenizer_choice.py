"""Stage 6's tokenizer: the one given, else the model directory's, else a byte-level stand-in written
by adapt (tiny qwen3_next / llama4 models ship none), refused with one line when it cannot fit."""

import json

import pytest
from tokenizers import Tokenizer

from adapt.bench.loadgen import choose_tokenizer, has_tokenizer, write_byte_tokenizer
from adapt.errors import InputError


def model_dir(tmp_path, vocab, *, text_config=False, tokenizer=False):
    directory = tmp_path / "model"
    directory.mkdir()
    config = {"model_type": "llama4", "text_config": {"vocab_size": vocab}} if text_config else {
        "model_type": "qwen3_next", "vocab_size": vocab}
    (directory / "config.json").write_text(json.dumps(config))
    if tokenizer:
        (directory / "tokenizer.json").write_text("{}")
    return directory


def test_byte_tokenizer_round_trips_any_text_with_ids_below_256(tmp_path):
    tokenizer = Tokenizer.from_file(str(write_byte_tokenizer(tmp_path / "tok") / "tokenizer.json"))
    text = "héllo wörld, 東京 \n\t<|end|> 123"
    ids = tokenizer.encode(text).ids
    assert tokenizer.get_vocab_size() == 256 and max(ids) < 256 and len(ids) == len(text.encode())
    assert tokenizer.decode(ids) == text
    assert has_tokenizer(tmp_path / "tok") and not has_tokenizer(tmp_path)


@pytest.mark.parametrize("text_config", [False, True])
def test_a_model_without_tokenizer_gets_the_stand_in(tmp_path, text_config):
    directory = model_dir(tmp_path, 256, text_config=text_config)
    path, source = choose_tokenizer(str(directory), None, tmp_path / "scratch")
    assert source == "byte-level" and path == str(tmp_path / "scratch") and has_tokenizer(tmp_path / "scratch")


def test_given_or_own_tokenizer_wins_and_bad_input_is_one_line(tmp_path):
    with_own = model_dir(tmp_path, 1000, tokenizer=True)
    assert choose_tokenizer(str(with_own), None, tmp_path / "s") == (str(with_own), "model")
    assert choose_tokenizer(str(with_own), "org/tok", tmp_path / "s") == ("org/tok", "given")
    assert choose_tokenizer("served-name", None, tmp_path / "s") == ("served-name", "model")
    with pytest.raises(InputError, match="no such tokenizer directory"):
        choose_tokenizer(str(with_own), str(tmp_path / "missing"), tmp_path / "s")
    (with_own / "tokenizer.json").unlink()
    (with_own / "config.json").write_text(json.dumps({"vocab_size": 100}))
    with pytest.raises(InputError, match="vocabulary of 100") as err:
        choose_tokenizer(str(with_own), None, tmp_path / "s")
    assert err.value.field == "--tokenizer" and not (tmp_path / "s").exists()
