"""Streaming detokenisation: the incremental decoder and stop strings against
the whole-text rescan they replace, and their per-token cost."""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable, Sequence
from itertools import accumulate
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.textstream import TextStream, truncate_at_stop
from llm_core.loading.checkpoint import SPECIAL_TOKENS, train_byte_level_tokenizer
from llm_core.model.presets import tiny
from llm_core.model.tokenizer import StreamDecoder, Tokenizer

DEMO_TOKENIZER = Path(__file__).parents[2] / "models" / "demo" / "tokenizer.json"
_REPLACEMENT = "\ufffd"
# Characters of 2 to 4 UTF-8 bytes: with these small vocabularies each becomes
# several byte tokens, so streams stop inside characters.
_MULTIBYTE = "é€😀中文ß"


class RescanningStream:
    """The way it was done before: decode every token so far for each new token
    and search all of that text for the stops. The oracle, and the baseline cost."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        self.decode, self.stops = decode, stops
        self.tokens: list[int] = []
        self.text = ""
        self.stopped = False

    def push(self, token: int, final: bool = False) -> str:
        self.tokens.append(token)
        text, self.stopped = truncate_at_stop(self.decode(self.tokens), self.stops)
        if not self.stopped and not final and text.endswith(_REPLACEMENT):
            return ""
        delta, self.text = text[len(self.text) :], text
        return delta


def _deltas(stream: TextStream | RescanningStream, tokens: Sequence[int]) -> list[str]:
    """Every delta until the stream stops or the tokens run out."""
    out = []
    for i, token in enumerate(tokens):
        out.append(stream.push(token, final=i == len(tokens) - 1))
        if stream.stopped:
            break
    return out


@pytest.fixture(scope="module", params=["demo", "tiny"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    if request.param == "demo":
        return Tokenizer(DEMO_TOKENIZER)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_byte_level_tokenizer(tiny().vocab_size, 0, SPECIAL_TOKENS).save(str(path))
    return Tokenizer(path)


def _token_lists(tokenizer: Tokenizer) -> st.SearchStrategy[list[int]]:
    """Any ids (lone and invalid UTF-8 bytes, special tokens included), real text
    with multi-byte characters, and runs of the pieces of such characters."""
    specials = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    pieces = sorted({*tokenizer.encode(_MULTIBYTE + " the a"), *specials})
    any_id = st.integers(0, tokenizer.vocab_size - 1)
    text = st.text(alphabet=st.sampled_from(_MULTIBYTE + "ab \n.xyz"), max_size=30)
    encoded = st.tuples(text, st.lists(st.sampled_from(specials), max_size=3), st.randoms()).map(
        lambda t: _sprinkle(tokenizer.encode(t[0]), t[1], t[2])
    )
    return st.one_of(
        st.lists(any_id, min_size=1, max_size=40),
        encoded.filter(bool),
        st.lists(st.sampled_from(pieces), min_size=1, max_size=40),
    )


def _sprinkle(ids: list[int], extra: list[int], rng: random.Random) -> list[int]:
    for token in extra:
        ids.insert(rng.randrange(len(ids) + 1), token)
    return ids


_SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_SETTINGS
@given(data=st.data())
def test_decoder_deltas_are_todays_and_add_up_to_decode(tokenizer: Tokenizer, data: st.DataObject) -> None:
    tokens = data.draw(_token_lists(tokenizer))
    whole = tokenizer.decode(tokens)
    deltas = _deltas(TextStream(tokenizer.stream_decoder()), tokens)
    old = _deltas(RescanningStream(tokenizer.decode, ()), tokens)
    assert "".join(deltas) == whole
    if _REPLACEMENT not in whole:
        assert deltas == old
    # Invalid bytes (U+FFFD in the answer itself): a long run of them may be sent
    # sooner than before, never anything that is not final.
    for sent, sent_before in zip(accumulate(deltas), accumulate(old)):
        assert whole.startswith(sent) and sent.startswith(sent_before)


@_SETTINGS
@given(data=st.data())
def test_stop_strings_cut_where_the_whole_text_is_cut(tokenizer: Tokenizer, data: st.DataObject) -> None:
    tokens = data.draw(_token_lists(tokenizer))
    whole = tokenizer.decode(tokens)
    # Mostly pieces of the answer itself, so stops are found, often across tokens.
    piece = st.tuples(st.integers(0, len(whole)), st.integers(1, 6)).map(lambda p: whole[p[0] : p[0] + p[1]])
    stops = data.draw(st.lists(st.one_of(piece, st.text("ab .€x", min_size=1, max_size=4)), min_size=1,
                               max_size=3).map(lambda s: [x for x in s if x and _REPLACEMENT not in x]))
    stream = TextStream(tokenizer.stream_decoder(), stops)
    deltas = _deltas(stream, tokens)
    used = len(deltas)
    # As a non-streamed answer of the tokens it took: cut before the earliest stop.
    assert ("".join(deltas), stream.stopped) == truncate_at_stop(tokenizer.decode(tokens[:used]), stops)
    # It stops at the token the whole-text rescan stops at, or (a stop's last
    # character in the same token as an incomplete one) when that character is complete.
    old = _deltas(RescanningStream(tokenizer.decode, stops), tokens)
    assert len(old) <= used
    if not tokenizer.decode(tokens[: len(old)]).endswith(_REPLACEMENT):
        assert used == len(old)


def test_a_stop_across_tokens_is_not_sent_before_it_is_known(tokenizer: Tokenizer) -> None:
    ids = [tokenizer.encode(c)[0] for c in "xabcdy"]
    # "bc" completes first though "abcd" starts earlier: the earliest found wins, as before.
    stream = TextStream(tokenizer.stream_decoder(), ["abcd", "bc"])
    assert _deltas(stream, ids) == ["x", "", "", "a"] and stream.stopped
    stream = TextStream(tokenizer.stream_decoder(), ["abd"])
    assert _deltas(stream, ids) == ["x", "", "", "abc", "d", "y"] and not stream.stopped  # "ab" held: not a stop


def test_a_run_of_incomplete_characters_keeps_the_window_short(tokenizer: Tokenizer) -> None:
    lead = tokenizer.encode("€")[0]  # the lead byte of a 3-byte character, alone
    windows: list[int] = []

    def decode(ids: list[int]) -> str:
        windows.append(len(ids))
        return tokenizer.decode(ids)

    tokens = [lead] * 500 + tokenizer.encode("€ and 😀" * 20)
    decoder = StreamDecoder(decode)
    text = "".join(decoder.push(t) for t in tokens) + decoder.flush()
    assert text == tokenizer.decode(tokens)
    assert max(windows) <= 8


# -- cost ------------------------------------------------------------------------------

ANSWER_TOKENS = 4000
_WINDOW = 100  # first and last tokens compared


def _long_answer(tokenizer: Tokenizer, n: int) -> list[int]:
    rng = random.Random(0)
    words = ["the", "red", "circle", "moves", "left", "colour", "café", "naïve", "€5", "😀", "中文", "beeps"]
    text = ""
    while len(tokenizer.encode(text)) < n:
        text += " ".join(rng.choice(words) for _ in range(50)) + ".\n"
    return tokenizer.encode(text)[:n]


def _costs(
    make: Callable[[], TextStream | RescanningStream], tokens: list[int], reps: int
) -> tuple[float, float, float]:
    """Mean seconds per token over the first and the last ``_WINDOW`` tokens, and
    seconds for all of them; each token's cost is its fastest of ``reps`` runs
    (the machine is shared)."""
    n = len(tokens)
    best = [float("inf")] * n
    gc.disable()
    try:
        for _ in range(reps):
            push = make().push
            for i, token in enumerate(tokens):
                start = time.perf_counter()
                push(token, i == n - 1)
                best[i] = min(best[i], time.perf_counter() - start)
    finally:
        gc.enable()
    return sum(best[:_WINDOW]) / _WINDOW, sum(best[-_WINDOW:]) / _WINDOW, sum(best)


def test_per_token_cost_is_flat_over_a_long_answer(suite_report: Callable[[str], None]) -> None:
    tokenizer = Tokenizer(DEMO_TOKENIZER)
    tokens = _long_answer(tokenizer, ANSWER_TOKENS)
    stops = ["\n\nUser:", "###"]  # never found: every token pays for the search
    assert len(tokens) == ANSWER_TOKENS and not truncate_at_stop(tokenizer.decode(tokens), stops)[1]

    new_first, new_last, new_all = _costs(lambda: TextStream(tokenizer.stream_decoder(), stops), tokens, reps=15)
    old_first, old_last, old_all = _costs(lambda: RescanningStream(tokenizer.decode, stops), tokens, reps=3)
    new_ratio, old_ratio = new_last / new_first, old_last / old_first
    suite_report(
        f"detokenise {ANSWER_TOKENS}-token answer, per token first {_WINDOW} / last {_WINDOW}: "
        f"incremental {new_first * 1e6:.1f} / {new_last * 1e6:.1f} us (x{new_ratio:.2f}, "
        f"{new_all * 1e3:.0f} ms in all), rescan {old_first * 1e6:.1f} / {old_last * 1e6:.1f} us "
        f"(x{old_ratio:.1f}, {old_all * 1e3:.0f} ms in all)"
    )
    assert new_ratio <= 1.5
    assert old_ratio > 5 * new_ratio  # the rescan grew with the text; the window does not
