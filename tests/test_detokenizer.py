"""IncrementalDetokenizer with the default model's byte-level BPE tokenizer and chosen token ids:
characters split over several tokens, stop strings split over several tokens."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from orca_backend.core.sampling_params import SamplingParams
from orca_backend.engine.detokenizer import IncrementalDetokenizer

PROMPT = "Answer:"
STOP_TEXT = "Hello world STOP and more"  # Hello | ' world' | ' ST' | 'OP' | ' and' | ' more'


@pytest.fixture(scope="module")
def tokenizer(default_model) -> Tokenizer:
    return Tokenizer.from_file(str(default_model / "tokenizer.json"))


def _detokenizer(tokenizer: Tokenizer, **params) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT).ids, SamplingParams(**params))


def _feed(detok: IncrementalDetokenizer, token_ids: list[int]) -> tuple[list[str], bool]:
    """Append token by token as the engine does: the delta after each, final once stopped."""
    deltas = []
    for token_id in token_ids:
        stopped = detok.append(token_id)
        deltas.append(detok.take_delta(final=stopped))
        if stopped:
            return deltas, True
    return deltas, False


# (text, its tokens as vocabulary strings or None to encode the text, expected delta per token).
# The vocabulary holds "é" whole too, but a model may emit its two byte tokens instead.
SPLIT_CHARACTERS = [
    ("é", ["Ã", "©"], ["", "é"]),
    ("ő", None, ["", "ő"]),
    ("漢", None, ["", "", "漢"]),
    ("🙂", None, ["", "🙂"]),
    ("👍🏽", None, ["", "", "👍", "", "", "🏽"]),  # two code points, each of three tokens
]


@pytest.mark.parametrize("text, pieces, expected", SPLIT_CHARACTERS, ids=[c[0] for c in SPLIT_CHARACTERS])
def test_a_character_split_over_tokens_is_emitted_whole(tokenizer, text, pieces, expected):
    char_ids = [tokenizer.token_to_id(p) for p in pieces] if pieces else tokenizer.encode(text).ids
    assert len(char_ids) == len(expected) > 1, f"{text!r} is {char_ids}, not split as the test needs"
    assert any(ord(c) > 127 for c in text) and tokenizer.decode(char_ids) == text
    ids = tokenizer.encode("A").ids + char_ids + tokenizer.encode(" done").ids
    deltas, stopped = _feed(_detokenizer(tokenizer), ids)
    assert not any("\ufffd" in d for d in deltas), deltas
    assert deltas == ["A", *expected, " done"] and not stopped
    assert "".join(deltas) == f"A{text} done" == tokenizer.decode(ids)


def test_a_character_cut_off_by_the_end_is_dropped_not_broken(tokenizer):
    detok = _detokenizer(tokenizer)
    first_half_of_emoji = tokenizer.encode("🙂").ids[0]
    deltas, _ = _feed(detok, tokenizer.encode("A").ids + [first_half_of_emoji])
    assert deltas == ["A", ""] and detok.take_delta(final=True) == "" and detok.text == "A"


@pytest.mark.parametrize("stop, include, expected", [
    # "STOP" comes from ' ST' and 'OP': "ST" is held back until 'OP' shows it is the stop.
    ("STOP", False, ["Hello", " world", " ", ""]),
    ("STOP", True, ["Hello", " world", " ", "STOP"]),
    # From three tokens: "world", then "world ST", is held back.
    ("world STOP", False, ["Hello", " ", "", ""]),
    ("world STOP", True, ["Hello", " ", "", "world STOP"]),
])
def test_a_stop_string_across_tokens_is_held_back_then_cut(tokenizer, stop, include, expected):
    detok = _detokenizer(tokenizer, stop=[stop], include_stop_str_in_output=include)
    deltas, stopped = _feed(detok, tokenizer.encode(STOP_TEXT).ids)
    assert stopped and deltas == expected
    assert "".join(deltas) == detok.text == STOP_TEXT[:STOP_TEXT.index(stop) + (len(stop) if include else 0)]


def test_the_earliest_of_several_stop_strings_cuts(tokenizer):
    # Both complete with 'OP'; the one listed second starts earlier in the text.
    detok = _detokenizer(tokenizer, stop=["STOP", "world STOP"])
    deltas, stopped = _feed(detok, tokenizer.encode(STOP_TEXT).ids)
    assert stopped and "".join(deltas) == detok.text == "Hello "


def test_a_held_prefix_that_is_no_stop_is_released(tokenizer):
    detok = _detokenizer(tokenizer, stop=["world peace"])
    deltas, stopped = _feed(detok, tokenizer.encode("Hello world war").ids)
    assert deltas == ["Hello", " ", "world war"] and not stopped


def test_a_held_prefix_is_released_when_the_request_ends(tokenizer):
    detok = _detokenizer(tokenizer, stop=["world peace"])
    deltas, _ = _feed(detok, tokenizer.encode("Hello world").ids)
    assert deltas == ["Hello", " "] and detok.take_delta(final=True) == "world"


@pytest.mark.parametrize("skip, expected", [(True, "Hello world"), (False, "Hello<|im_end|> world")])
def test_special_tokens_are_skipped_unless_asked_for(tokenizer, skip, expected):
    ids = tokenizer.encode("Hello").ids + [tokenizer.token_to_id("<|im_end|>")] + tokenizer.encode(" world").ids
    deltas, _ = _feed(_detokenizer(tokenizer, skip_special_tokens=skip), ids)
    assert "".join(deltas) == expected
