"""One tenancy key (serving/suffix_share.py: ``tenant_key``) scopes both caches whose reuse shows
in timing: the API key and the ``cache_salt``. Two requests of one key with different salts get
different suffix-draft groups and prefix-cache groups; one key and one salt share both; the salt
isolates under ``global`` too, which drops only the API key; ``none`` turns off suffix sharing
and keeps per-tenant prefixes. The end-to-end check through the server, with what the suffix
cache holds per group, is in test_suffix_share.py."""

import pytest

from specdecode.drafters.suffix_cache import DEFAULT_GROUP
from specdecode.serving.suffix_share import SUFFIX_SHARES, cache_group, suffix_group, tenant_key

ALICE, BOB = "Bearer alice", "Bearer bob"


@pytest.mark.parametrize("share", ["tenant", "global"])
def test_one_key_per_api_key_and_salt_for_both_caches(share: str) -> None:
    for authorization in (ALICE, None):
        for salt in (None, "s1", "s2"):
            key = tenant_key(share, authorization, salt)
            assert suffix_group(share, authorization, salt) == cache_group(share, authorization, salt) == key
    assert tenant_key(share, ALICE, "s1") == tenant_key(share, ALICE, "s1")
    assert len({tenant_key(share, ALICE, salt) for salt in (None, "s1", "s2")}) == 3


def test_the_salt_isolates_a_key_under_tenant() -> None:
    same_key = [suffix_group("tenant", ALICE, salt) for salt in (None, "s1", "s2")]
    assert len(set(same_key)) == 3
    assert suffix_group("tenant", ALICE, "s1") != suffix_group("tenant", BOB, "s1")  # a salt is not a key
    assert "s1" not in suffix_group("tenant", ALICE, "s1") and "alice" not in suffix_group("tenant", ALICE, "s1")


def test_global_drops_the_api_key_but_not_the_salt() -> None:
    assert suffix_group("global", ALICE, None) == suffix_group("global", BOB, None) == DEFAULT_GROUP
    assert suffix_group("global", ALICE, "s1") == suffix_group("global", BOB, "s1") != DEFAULT_GROUP
    assert suffix_group("global", ALICE, "s1") != suffix_group("global", ALICE, "s2")


def test_none_drafts_alone_and_keeps_the_tenants_prefixes() -> None:
    assert suffix_group("none", ALICE, "s1") is None
    assert cache_group("none", ALICE, "s1") == cache_group("tenant", ALICE, "s1") != cache_group("none", ALICE, None)


def test_an_unknown_share_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=", ".join(SUFFIX_SHARES)):
        tenant_key("everyone", ALICE, None)
