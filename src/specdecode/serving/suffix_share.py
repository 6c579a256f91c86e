"""Who shares what with whom: the tenancy key of a request, which scopes both caches whose reuse
shows in timing, suffix decoding's earlier responses (``suffix_group``) and cached prompt
prefixes (``cache_group``); ``--suffix-share tenant|global|none``.

Suffix decoding drafts from earlier responses (``drafters/suffix_cache.py``), and reused prefix
K/V skips a prefill; both make a request return sooner when someone sent similar text before,
which tells its sender so. So both are shared only within one tenancy key (``tenant_key``):

- the API key (the bearer token of the ``Authorization`` header; requests without one are one
  tenant), except under ``global``, which drops it: every request shares, for a server whose
  users all trust each other;
- and the request's ``cache_salt`` (vLLM's field), whatever the setting: clients of one key (or
  of a ``global`` server) who must not share send different salts, and share neither cached
  prefixes nor suffix drafts.

``none`` turns off sharing of suffix drafts (each request drafts from its own prompt and output);
the prefix cache then keeps the ``tenant`` key, so a tenant's next turn still reuses its prefix.
Keys are hashes of the API key and the salt, so the caches hold neither. A new cache that leaks
through timing takes its group from ``tenant_key`` too.
"""

from __future__ import annotations

import hashlib

from specdecode.drafters.suffix_cache import DEFAULT_GROUP

SUFFIX_SHARES = ("tenant", "global", "none")
DEFAULT_SUFFIX_SHARE = "tenant"
ANONYMOUS = "tenant:anonymous"
DIGEST_CHARS = 32  # 128 bits of SHA-256: no two keys or salts collide in practice


def _digest(text: str) -> str:
    # surrogatepass: a library caller's salt is not checked as a request's is (serving/unicode_check.py).
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:DIGEST_CHARS]


def _api_key_tenant(authorization: str | None) -> str:
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return ANONYMOUS
    return "tenant:" + _digest(token)


def tenant_key(share: str, authorization: str | None, salt: str | None) -> str:
    """The tenancy key of a request with this ``Authorization`` header and ``cache_salt``: the
    API key (none under ``global``) and the salt. Requests share cached state only within one."""
    if share not in SUFFIX_SHARES:
        raise ValueError(f"suffix share must be one of {', '.join(SUFFIX_SHARES)}, got {share!r}")
    owner = DEFAULT_GROUP if share == "global" else _api_key_tenant(authorization)
    return owner if salt is None else f"{owner}/salt:{_digest(salt)}"


def suffix_group(share: str, authorization: str | None, salt: str | None = None) -> str | None:
    """The suffix-cache group of a request (None: it drafts from its own text only)."""
    return None if share == "none" else tenant_key(share, authorization, salt)


def cache_group(share: str, authorization: str | None, salt: str | None) -> str:
    """The prefix-cache group of a request: its tenancy key (``none`` keeps per-tenant prefixes)."""
    return tenant_key(share, authorization, salt)
