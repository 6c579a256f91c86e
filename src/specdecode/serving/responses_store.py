"""The stored responses of ``/v1/responses``, for ``previous_response_id`` and
``GET``/``DELETE /v1/responses/{id}``: bounded, and kept apart per tenant.

A stored response is its Response body, the conversation it ended (chat-completions messages:
the earlier turns, its input, its output as an assistant message), so that a next request naming
it continues from those messages, and its input items (the earlier turns' input and output
items, then its input, each with an id) for ``GET /v1/responses/{id}/input_items``. OpenAI keeps responses for 30 days; a server in one process
keeps them in memory, so the store is bounded three ways, each by least-recent use (a read counts
as a use): ``max_per_tenant`` responses and ``max_tenant_bytes`` per tenant, and
``max_total_bytes`` over all tenants. A response larger than a tenant's whole budget is not kept.

Tenants are API keys (``serving/suffix_share.py``'s ``tenant_key`` under ``tenant``, whatever
``--suffix-share`` says: a stored response is another user's text, not a timing channel that
a trusting server may choose to share). One key cannot read, continue or delete another's
responses: to it they do not exist (a 404, the same as an id never issued).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from specdecode.serving.suffix_share import tenant_key

DEFAULT_MAX_PER_TENANT = 256
DEFAULT_MAX_TENANT_BYTES = 32 * 2**20
DEFAULT_MAX_TOTAL_BYTES = 256 * 2**20


def response_tenant(authorization: str | None) -> str:
    """The store's tenant of a request with this ``Authorization`` header: its API key's hash."""
    return tenant_key("tenant", authorization, None)


@dataclass(slots=True, frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the Response object as returned
    conversation: list[dict[str, Any]]  # chat messages up to and including this response's output
    size: int  # bytes of all three as JSON: what the byte bounds count
    input_items: list[dict[str, Any]] = field(default_factory=list)  # in OpenAI's item shapes, oldest first


class ResponseStore:
    """A per-tenant LRU of responses; safe to use from several threads."""

    def __init__(self, max_per_tenant: int = DEFAULT_MAX_PER_TENANT, max_tenant_bytes: int = DEFAULT_MAX_TENANT_BYTES,
                 max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES) -> None:
        if max_per_tenant < 1 or max_tenant_bytes < 1 or max_total_bytes < 1:
            raise ValueError("the response store's bounds must be positive")
        self.max_per_tenant, self.max_tenant_bytes = max_per_tenant, max_tenant_bytes
        self.max_total_bytes = max_total_bytes
        self._lock = threading.Lock()
        self._tenants: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._tenant_bytes: dict[str, int] = {}
        self._order: OrderedDict[tuple[str, str], None] = OrderedDict()  # every entry, least recent first
        self.total_bytes = 0

    def __len__(self) -> int:
        return len(self._order)

    def tenant_bytes(self, tenant: str) -> int:
        return self._tenant_bytes.get(tenant, 0)

    def put(self, tenant: str, body: dict[str, Any], conversation: list[dict[str, Any]],
            input_items: list[dict[str, Any]] | None = None) -> bool:
        """Keep ``body`` (its ``id`` the key), its conversation and its input items; False when
        it alone is over a tenant's byte budget (it is then not kept)."""
        input_items = input_items or []
        size = sum(len(json.dumps(part, ensure_ascii=False)) for part in (body, conversation, input_items))
        if size > min(self.max_tenant_bytes, self.max_total_bytes):
            return False
        response_id = body["id"]
        with self._lock:
            self._remove(tenant, response_id)
            entries = self._tenants.setdefault(tenant, OrderedDict())
            entries[response_id] = StoredResponse(body, conversation, size, input_items)
            self._order[(tenant, response_id)] = None
            self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + size
            self.total_bytes += size
            while len(entries) > self.max_per_tenant or self._tenant_bytes[tenant] > self.max_tenant_bytes:
                self._remove(tenant, next(iter(entries)))
            while self.total_bytes > self.max_total_bytes:
                self._remove(*next(iter(self._order)))
        return True

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's response ``response_id`` (now its most recent), or None."""
        with self._lock:
            entries = self._tenants.get(tenant)
            found = entries.get(response_id) if entries is not None else None
            if found is not None:
                entries.move_to_end(response_id)
                self._order.move_to_end((tenant, response_id))
            return found

    def delete(self, tenant: str, response_id: str) -> bool:
        """Forget the tenant's response ``response_id``; False when it had none by that id."""
        with self._lock:
            return self._remove(tenant, response_id)

    def _remove(self, tenant: str, response_id: str) -> bool:
        entries = self._tenants.get(tenant)
        found = entries.pop(response_id, None) if entries is not None else None
        if found is None:
            return False
        del self._order[(tenant, response_id)]
        self._tenant_bytes[tenant] -= found.size
        self.total_bytes -= found.size
        if not entries:
            del self._tenants[tenant], self._tenant_bytes[tenant]
        return True
