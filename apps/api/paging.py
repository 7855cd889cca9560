"""Every list is paginated: `limit` items from `offset`, the same bounds everywhere."""

from ninja import Query

Offset = Query(0, ge=0, le=1_000_000)
Limit = Query(100, ge=1, le=500)
