"""Block-chain hashing: exact cases, chat prefix property, key spaces, config errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

from kvgate.core.errors import ClientRequestError, ConfigError
from kvgate.core.hashing import (
    Hasher,
    ReadyIdsHasher,
    TextChunkHasher,
    TokenBlockHasher,
    canonical_messages,
    chain_from_ids,
    ensure_same_key_space,
    make_hasher,
)
from kvgate.core.hashing.base import root_seed

Msg = tuple[str, str]


def u32(s: str) -> bytes:
    return s.encode("utf-32-le", "surrogatepass")


def parse_canonical(s: str) -> list[Msg]:
    """Inverse of canonical_messages: its existence proves the encoding injective."""
    out: list[Msg] = []
    i = 0

    def field(i: int) -> tuple[str, int]:
        j = s.index("\x1f", i)
        n = int(s[i:j])
        return s[j + 1 : j + 1 + n], j + 1 + n

    while i < len(s):
        assert s[i] == "\x1e"
        role, i = field(i + 1)
        content, i = field(i)
        out.append((role, content))
    return out


# ------------------------------------------------------------------ text: exact cases


def test_defaults() -> None:
    h = TextChunkHasher()
    assert (h.key_space, h.tokens_per_block, h.block_chars) == ("text256", 64, 256)
    hasher: Hasher = h  # structural conformance
    assert hasher.chain_for_prompt("") == ()


def test_golden_values_are_stable() -> None:
    # The format is a contract between gateway replicas sharing an index: a change
    # here must come with a FORMAT_VERSION bump.
    h = TextChunkHasher()
    assert h.chain_for_prompt("x" * 600) == (0xF4AC09ED8DD9BC41, 0x041207F5CC1F79A1)
    msgs = [("system", "s" * 300), ("user", "héllo ✓ 😀" * 40)]
    assert h.chain_for_messages(msgs) == (0xC33EC768FBCC4C7A, 0xB7F9E91341F25AE7)


def test_chain_is_xxh3_seeded_by_previous_hash() -> None:
    h = TextChunkHasher(block_chars=4)
    c = h.chain_for_prompt("abcdefgh")
    assert len(c) == 2
    assert c[1] == xxh3_64_intdigest(u32("efgh"), seed=c[0])
    # block 0 is seeded by a constant of the key space (and of prompt vs chat)
    assert c[0] == xxh3_64_intdigest(u32("abcd"), seed=root_seed("text4", "prompt"))
    assert all(0 <= x < 2**64 for x in c)


def test_partial_trailing_block_is_not_a_block() -> None:
    h = TextChunkHasher(block_chars=4)
    assert h.chain_for_prompt("abc") == ()
    assert h.chain_for_prompt("abcdefg") == h.chain_for_prompt("abcd")
    assert len(h.chain_for_prompt("abcdefgh")) == 2
    assert h.chain_for_prompt("abcdefghi") == h.chain_for_prompt("abcdefgh")


def test_changing_block_two_changes_only_h2_onwards() -> None:
    h = TextChunkHasher(block_chars=4)
    a = h.chain_for_prompt("aaaabbbbcccc")
    b = h.chain_for_prompt("aaaaBbbbcccc")
    assert a[0] == b[0]
    assert a[1] != b[1] and a[2] != b[2]


def test_identical_prefixes_share_leading_hashes() -> None:
    h = TextChunkHasher(block_chars=8)
    a = h.chain_for_prompt("You are helpful. Question one?")
    b = h.chain_for_prompt("You are helpful. Something else entirely.")
    assert a[:2] == b[:2]
    assert a[2] != b[2]


@given(st.text(max_size=80), st.text(max_size=80))
def test_prefix_of_text_gives_prefix_of_chain(a: str, b: str) -> None:
    h = TextChunkHasher(block_chars=4)
    full = h.chain_for_prompt(a + b)
    assert full[: len(a) // 4] == h.chain_for_prompt(a)
    assert len(full) == len(a + b) // 4


def test_estimates_round_up() -> None:
    h = TextChunkHasher()
    assert [h.estimate_tokens_prompt("x" * n) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]


# ----------------------------------------------------------------------- text: unicode


def test_blocks_are_characters_not_bytes() -> None:
    h = TextChunkHasher(block_chars=4)
    c = h.chain_for_prompt("éééé日本語😀x")  # 2- 3- and 4-byte UTF-8 characters
    assert len(c) == 2
    assert c[1] == xxh3_64_intdigest(u32("日本語😀"), seed=c[0])


def test_ascii_and_non_ascii_blocks_are_consistent() -> None:
    # A block's hash depends on its characters only: a later non-ASCII block
    # must not change the hashes of earlier ASCII blocks.
    h = TextChunkHasher(block_chars=4)
    ascii_only = h.chain_for_prompt("abcdefghijkl")
    mixed = h.chain_for_prompt("abcdefgh✓jkl")
    assert ascii_only[:2] == mixed[:2] and ascii_only[2] != mixed[2]
    assert h.chain_for_prompt("✓bcdefgh")[1] != ascii_only[1]


def test_any_str_is_accepted() -> None:
    h = TextChunkHasher(block_chars=4)
    assert len(h.chain_for_prompt("ab\ud800cdef\x00")) == 2  # lone surrogate, NUL


@given(st.text(min_size=0, max_size=60))
def test_unicode_chain_matches_per_block_definition(s: str) -> None:
    h = TextChunkHasher(block_chars=4)
    chain = h.chain_for_prompt(s)
    assert len(chain) == len(s) // 4
    for i in range(1, len(chain)):
        assert chain[i] == xxh3_64_intdigest(u32(s[4 * i : 4 * i + 4]), seed=chain[i - 1])


# ------------------------------------------------------------------------ text: chats

roles = st.sampled_from(["system", "user", "assistant", "tool", "", "us\x1fer", "1"])
contents = st.text(max_size=40)
messages = st.lists(st.tuples(roles, contents), max_size=6)


@given(messages, messages)
def test_chat_prefix_property(history: list[Msg], more: list[Msg]) -> None:
    h = TextChunkHasher(block_chars=4)
    assert canonical_messages(history + more).startswith(canonical_messages(history))
    short, long = h.chain_for_messages(history), h.chain_for_messages(history + more)
    assert long[: len(short)] == short


@given(messages, messages)
def test_chat_serialisation_is_injective(a: list[Msg], b: list[Msg]) -> None:
    assert parse_canonical(canonical_messages(a)) == a
    if a != b:
        assert canonical_messages(a) != canonical_messages(b)


@given(messages)
def test_chat_estimate_is_canonical_chars_over_4(ms: list[Msg]) -> None:
    h = TextChunkHasher()
    est = h.estimate_tokens_messages(ms)
    assert est == -(-len(canonical_messages(ms)) // 4)
    assert len(h.chain_for_messages(ms)) * h.tokens_per_block <= est


@pytest.mark.parametrize(
    "other",
    [
        [("user", "hello"), ("user", "world")],  # moved content boundary
        [("user", "hellowor"), ("user", "ld")],
        [("use", "rhelloworld")],  # moved role/content boundary
        [("user", "helloworld"), ("", "")],  # an extra empty message
        [("assistant", "helloworld")],
    ],
)
def test_chat_boundaries_change_the_chain(other: list[Msg]) -> None:
    h = TextChunkHasher(block_chars=4)
    base = [("user", "helloworld")]
    assert h.chain_for_messages(other) != h.chain_for_messages(base)


def test_prompt_and_chat_are_seeded_apart() -> None:
    h = TextChunkHasher(block_chars=4)
    ms = [("user", "some longer content here")]
    assert h.chain_for_prompt(canonical_messages(ms))[0] != h.chain_for_messages(ms)[0]


# -------------------------------------------------------------------------- processes


def test_deterministic_across_processes() -> None:
    code = (
        "from kvgate.core.hashing import TextChunkHasher as T;"
        "h=T(block_chars=8);"
        "print(list(h.chain_for_prompt('hello déjà vu '*5)),"
        "list(h.chain_for_messages([('user','hi there, friend'),('assistant','ok'*9)])))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    h = TextChunkHasher(block_chars=8)
    mine = (
        f"{list(h.chain_for_prompt('hello déjà vu ' * 5))} "
        f"{list(h.chain_for_messages([('user', 'hi there, friend'), ('assistant', 'ok' * 9)]))}"
    )
    assert out == mine


# ---------------------------------------------------------------------------- tokens

VOCAB = ["[UNK]", "<|", "|>", "user", "assistant", "system", "a", "b", "c", "d", "e", "f"]


def build_tokenizer(path: Path, vocab: Sequence[str] = VOCAB) -> Path:
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))
    return path


@pytest.fixture
def tok_file(tmp_path: Path) -> Path:
    return build_tokenizer(tmp_path / "tokenizer.json")


def test_token_chain_exact(tok_file: Path) -> None:
    h = TokenBlockHasher.from_file(tok_file, block_size=2)
    assert h.key_space.startswith("tokens2:") and h.tokens_per_block == 2
    c = h.chain_for_tokens([1, 2, 3, 4, 5])  # trailing partial block [5] excluded
    assert len(c) == 2
    assert c[1] == xxh3_64_intdigest((3).to_bytes(4, "little") + (4).to_bytes(4, "little"), c[0])
    assert h.chain_for_tokens([3, 4, 5], parent=c[0]) == c[1:]
    assert h.chain_for_tokens([1, 2, 9, 9])[0] == c[0]
    assert h.chain_for_tokens([]) == ()


def test_token_prompt_and_messages(tok_file: Path) -> None:
    h = TokenBlockHasher.from_file(tok_file, block_size=2)
    assert h.tokens_for_prompt("a b c zz") == [6, 7, 8, 0]
    assert h.chain_for_prompt("a b c zz") == h.chain_for_tokens([6, 7, 8, 0])
    assert h.estimate_tokens_prompt("a b c zz") == 4
    ms = [("user", "a b"), ("assistant", "c")]
    assert h.render_messages(ms) == "<|user|>\na b\n<|assistant|>\nc\n"
    assert h.tokens_for_messages(ms) == [1, 3, 2, 6, 7, 1, 4, 2, 8]
    assert h.estimate_tokens_messages(ms) == 9
    assert h.chain_for_messages(ms) == h.chain_for_tokens([1, 3, 2, 6, 7, 1, 4, 2, 8])
    longer = h.chain_for_messages([*ms, ("user", "d e f")])
    assert longer[: len(h.chain_for_messages(ms))] == h.chain_for_messages(ms)


def test_token_chains_differ_by_model(tok_file: Path) -> None:
    h = TokenBlockHasher.from_file(tok_file, block_size=2)
    ids = [6, 7, 8, 0, 6, 7]
    assert h.chain_for_tokens(ids, model="") == h.chain_for_tokens(ids)
    base = h.chain_for_tokens(ids, model="base")
    assert base != h.chain_for_tokens(ids) and base != h.chain_for_tokens(ids, model="sql-lora")
    # a stored event's blocks continue from their parent whatever the model
    assert h.chain_for_tokens(ids[2:], parent=base[0], model="base") == base[1:]
    assert h.chain_for_prompt("a b c zz", "base") == h.chain_for_tokens([6, 7, 8, 0], model="base")


def test_custom_chat_template(tok_file: Path) -> None:
    h = TokenBlockHasher.from_file(tok_file, chat_template="{role} {content} ")
    assert h.tokens_for_messages([("user", "a"), ("system", "{role}")]) == [3, 6, 5, 0, 0, 0]


class CountingEncoder:
    def __init__(self) -> None:
        self.calls = 0

    @property
    def fingerprint(self) -> str:
        return "fake"

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        self.calls += 1
        return [len(w) for w in text.split()]


def test_chain_then_estimate_tokenizes_once() -> None:
    enc = CountingEncoder()
    h = TokenBlockHasher(enc, block_size=2)
    assert h.key_space == "tokens2:fake"
    h.chain_for_prompt("aa b ccc")
    assert h.estimate_tokens_prompt("aa b ccc") == 3 and enc.calls == 1
    ms = [("user", "x y")]
    h.chain_for_messages(ms)
    assert h.estimate_tokens_messages(ms) == 3 and enc.calls == 2  # "<|user|>", "x", "y"
    h.estimate_tokens_prompt("aa b ccc")
    assert enc.calls == 3


@pytest.mark.parametrize("bad", [[-1], [2**32], ["a"]])
def test_bad_token_ids(tok_file: Path, bad: list[int]) -> None:
    h = TokenBlockHasher.from_file(tok_file)
    with pytest.raises(ClientRequestError):
        h.chain_for_tokens(bad)


def test_token_key_spaces_separate(tmp_path: Path, tok_file: Path) -> None:
    other = build_tokenizer(tmp_path / "other.json", [*VOCAB, "g"])
    a = TokenBlockHasher.from_file(tok_file)
    again = TokenBlockHasher.from_file(tok_file, chat_template="{content}")
    b = TokenBlockHasher.from_file(other)
    a32 = TokenBlockHasher.from_file(tok_file, block_size=32)
    ensure_same_key_space(a, again)  # template is not part of the key space
    assert len({a.key_space, b.key_space, a32.key_space}) == 3
    assert a.chain_for_tokens(range(16)) != b.chain_for_tokens(range(16))
    pairs: list[tuple[Hasher | str, Hasher | str]] = [
        (a, b),
        (a, a32),
        (a, TextChunkHasher()),
        (TextChunkHasher(128), "text256"),
    ]
    for x, y in pairs:
        with pytest.raises(ConfigError):
            ensure_same_key_space(x, y)
    ensure_same_key_space(TextChunkHasher(), "text256")


def test_tokenizer_fingerprint_stable_across_processes(tok_file: Path) -> None:
    code = (
        "import sys; from kvgate.core.hashing import TokenBlockHasher as T;"
        "print(T.from_file(sys.argv[1]).key_space)"
    )
    env = {**os.environ, "PYTHONHASHSEED": "7"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(tok_file)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out == TokenBlockHasher.from_file(tok_file).key_space


# ----------------------------------------------------------------------------- trace


def test_trace_ids() -> None:
    h = ReadyIdsHasher()
    assert (h.key_space, h.tokens_per_block) == ("trace512", 512)
    assert h.chain_from_ids([5, 6, 7]) == (5, 6, 7) == chain_from_ids([5, 6, 7])
    for call in (
        lambda: h.chain_for_prompt("x"),
        lambda: h.chain_for_messages([("user", "x")]),
        lambda: h.estimate_tokens_prompt("x"),
        lambda: h.estimate_tokens_messages([]),
    ):
        with pytest.raises(ConfigError):
            call()


# ---------------------------------------------------------------------------- config


def test_make_hasher(tok_file: Path) -> None:
    assert make_hasher("text").key_space == "text256"
    assert make_hasher("text", block_chars=128).tokens_per_block == 32
    assert make_hasher("trace", tokens_per_block=16).key_space == "trace16"
    t = make_hasher("tokens", path=str(tok_file), block_size=8, chat_template="{content}")
    assert t.key_space == TokenBlockHasher.from_file(tok_file, block_size=8).key_space


@pytest.mark.parametrize(
    ("kind", "params"),
    [
        ("nope", {}),
        ("text", {"block_size": 16}),
        ("text", {"block_chars": "256"}),
        ("text", {"block_chars": True}),
        ("text", {"block_chars": 3}),
        ("trace", {"tokens_per_block": 0}),
        ("tokens", {}),
        ("tokens", {"path": 5}),
        ("tokens", {"path": "/nonexistent/tokenizer.json"}),
    ],
)
def test_make_hasher_config_errors(kind: str, params: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        make_hasher(kind, **params)


def test_token_config_errors(tmp_path: Path, tok_file: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(ConfigError):
        TokenBlockHasher.from_file(bad)
    with pytest.raises(ConfigError):
        TokenBlockHasher.from_file(tok_file, block_size=0)
    for template in ("{role} {oops}", "{0}", "{role"):
        with pytest.raises(ConfigError):
            TokenBlockHasher.from_file(tok_file, chat_template=template)
    with pytest.raises(ConfigError):
        make_hasher("tokens", path=str(tok_file), chat_template=3)
    with pytest.raises(ConfigError):
        TextChunkHasher(block_chars=0)


def test_missing_tokenizers_extra(monkeypatch: pytest.MonkeyPatch, tok_file: Path) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ConfigError, match=r"kvgate\[tokenizers\]"):
        TokenBlockHasher.from_file(tok_file)
