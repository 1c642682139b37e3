"""The wire streams as the product makes and reads them, for tests that build their own:
a snapshot encoded by hubd's ``snapshot.Table`` (what ``GET /v2/snapshot`` sends), change
records as ``hubd.changes`` writes them (then ``protocol.encode_changes``, as hubd does),
and a pack answer decoded by the spoke's streaming ``protocol.PackDecoder`` (as
``HubClient.fetch_pack`` decodes it). Nothing here knows the formats: each builds on the
function the product calls.
"""

from __future__ import annotations

from hubd.snapshot import TableBuilder
from spokefs import protocol


def snapshot(generation: int, root_id: int, entries: list[protocol.Entry],
             level: int = 6) -> bytes:
    """The snapshot stream of ``entries`` (root first, parents before children; nothing is
    checked: hostile entries go out as they are), encoded as hubd encodes a scan's table.
    Entries that share an id are one inode (hard links)."""
    builder = TableBuilder()
    for e in entries:
        builder.add(e, 0, e.file_id)
    return builder.build(root_id).encode(generation, level)


def upsert(entry: protocol.Entry) -> bytes:
    """One UPSERT change record, as ``hubd.changes`` writes it: the record type, then the
    entry in its snapshot encoding (``Table.record``)."""
    return bytes((protocol.CHANGE_UPSERT,)) + protocol.encode_entry(entry)


def decode_pack(body: bytes, items: list[tuple[int, int]], piece: int = 1 << 16
                ) -> dict[tuple[int, int], tuple[bytes, int] | None]:
    """A whole pack answer, scanned by ``protocol.PackDecoder`` in pieces as it lands (as
    the spoke's hub client does): ``(file id, version) -> (bytes, xxh3_64)``, None for a
    member gone on the hub. Raises ``protocol.WireError`` as the decoder does; checksums are
    the caller's to check."""
    decoder = protocol.PackDecoder(items)
    view = memoryview(body)
    out: dict[tuple[int, int], tuple[bytes, int] | None] = {}
    for end in [*range(piece, len(body), piece), len(body)]:
        out.update((key, None if rec is None else (bytes(rec[0]), rec[1]))
                   for key, rec in decoder.scan(view, end))
    decoder.finish(len(body))
    return out
