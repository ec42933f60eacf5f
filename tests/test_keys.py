"""Keys: namespace digests and hash chains are stable, deterministic and separate namespaces."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvtier.kvstore.keys import Namespace, chain, header_digests

NS = Namespace("llama-3-8b", "bf16", 4, "paged-nhd")
TOKENS = list(range(12))

# Fixed vectors: a change here breaks every stored cache, so it must be deliberate.
NS_DIGEST = "9a34641a75253b29c5f27338693f3de250fa082b669cc93db6d07ea8c551bfb6"
XXH3_CHAIN = [
    "be20d79e2963d3247fe1a4fdc9f6055f",
    "6f21534dedfafee3173fc44b128fcfaf",
    "b458fb76a1b4c1b7189c2d02c2b61b41",
]
SHA256_CHAIN = [
    "565bbdd8edf3ef9373a36635943cf7a990920beb6dd6eb756fa3d16b22ca7876",
    "834d8ae31eef800781672fd24878b975c4bfb4ab895df1aeb64aa6737f4f2d51",
    "83fe0e9641ec3c6c935a1a3e28e264f468bf2c31360f6fa03c49526dac0af6cd",
]
HEADERS = ["da4bbdd84c6ec1b106cc74525ce9e103", "b6c89861d3f021acbf61c704b3aba2fd", "161c0595865d4d1ef0fe11875524b436"]


def test_namespace_digest_matches_the_fixed_vector() -> None:
    assert NS.digest.hex() == NS_DIGEST


def test_xxh3_chain_matches_the_fixed_vector() -> None:
    assert [k.hex() for k in chain(NS, TOKENS)] == XXH3_CHAIN


def test_sha256_chain_matches_the_fixed_vector() -> None:
    assert [k.hex() for k in chain(NS, TOKENS, "sha256")] == SHA256_CHAIN


def test_header_digests_match_the_fixed_vector() -> None:
    assert [h.hex() for h in header_digests(NS, TOKENS, chain(NS, TOKENS))] == HEADERS


def test_lists_arrays_and_bytes_give_the_same_chain() -> None:
    as_array = np.arange(12, dtype=np.int64)
    as_bytes = np.arange(12, dtype="<u4").tobytes()
    assert chain(NS, TOKENS) == chain(NS, as_array) == chain(NS, as_bytes)


def test_only_full_blocks_get_keys() -> None:
    assert len(chain(NS, list(range(15)))) == 3
    assert chain(NS, [1, 2, 3]) == []


def test_a_key_depends_on_the_whole_prefix() -> None:
    changed = [99, *TOKENS[1:]]
    assert all(a != b for a, b in zip(chain(NS, TOKENS), chain(NS, changed), strict=True))


def test_shared_prefix_gives_shared_leading_keys() -> None:
    other = [*TOKENS[:8], 7, 7, 7, 7]
    a, b = chain(NS, TOKENS), chain(NS, other)
    assert a[:2] == b[:2] and a[2] != b[2]


@pytest.mark.parametrize(
    "other",
    [
        Namespace("llama-3-70b", "bf16", 4, "paged-nhd"),
        Namespace("llama-3-8b", "fp8", 4, "paged-nhd"),
        Namespace("llama-3-8b", "bf16", 4, "paged-hnd"),
        Namespace("llama-3-8b", "bf16", 4, "paged-nhd", tenant="acme"),
    ],
)
def test_namespaces_never_share_keys(other: Namespace) -> None:
    assert set(chain(NS, TOKENS)).isdisjoint(chain(other, TOKENS))


def test_chain_is_identical_in_another_process() -> None:
    code = (
        "from kvtier.kvstore.keys import Namespace, chain;"
        "print(','.join(k.hex() for k in chain(Namespace('llama-3-8b','bf16',4,'paged-nhd'), list(range(12)))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().split(",") == XXH3_CHAIN


@pytest.mark.parametrize("bad", [[-1, 2, 3, 4], [2**32, 1, 2, 3], [[1, 2], [3, 4]], [0.5, 1.0, 2.0, 3.0]])
def test_invalid_tokens_are_rejected(bad: list) -> None:
    with pytest.raises(ValueError):
        chain(NS, bad)


def test_unknown_hash_algorithm_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        chain(NS, TOKENS, "md5")
