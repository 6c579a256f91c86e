"""Whose earlier responses a request's suffix decoding reads: ``--suffix-share tenant|global|none``;
and whose cached prompt prefixes it reuses (``cache_group``).

Suffix decoding drafts from earlier responses (``drafters/suffix_cache.py``), and a tree shared
across users leaks through timing: a request that speculates well, and so returns sooner,
tells its sender that someone sent similar text before. So by default (``tenant``) requests
share only with requests that carry the same API key (the bearer token of their
``Authorization`` header; requests without one are one tenant). ``global`` shares among all
requests, for a server whose users all trust each other; ``none`` keeps each request to its
own prompt and output. Groups are named by a hash of the key, so the cache holds no keys.
"""

from __future__ import annotations

import hashlib

from specdecode.drafters.suffix_cache import DEFAULT_GROUP

SUFFIX_SHARES = ("tenant", "global", "none")
DEFAULT_SUFFIX_SHARE = "tenant"
ANONYMOUS = "tenant:anonymous"


def suffix_group(share: str, authorization: str | None) -> str | None:
    """The suffix-cache group of a request with this ``Authorization`` header (None: none)."""
    if share == "none":
        return None
    if share == "global":
        return DEFAULT_GROUP
    if share != "tenant":
        raise ValueError(f"suffix share must be one of {', '.join(SUFFIX_SHARES)}, got {share!r}")
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return ANONYMOUS
    return "tenant:" + hashlib.sha256(token.encode()).hexdigest()[:32]


def cache_group(share: str, authorization: str | None, salt: str | None) -> str:
    """The prefix-cache group of a request: its tenant (every request with ``global``; per API key
    otherwise, ``none`` included: a tenant's own next turn reuses its prefix) and its
    ``cache_salt``. Reused KV answers sooner, so a prefix is never shared across groups."""
    tenant = suffix_group("global" if share == "global" else "tenant", authorization)
    if salt is None:
        return str(tenant)
    return f"{tenant}/salt:" + hashlib.sha256(salt.encode("utf-8", "surrogatepass")).hexdigest()[:32]
