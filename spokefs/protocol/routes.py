"""The routes, headers and media types of protocol v2, and how ids and ETags are written in
them (docs/protocol.md, "Routes")."""

from __future__ import annotations

from spokefs.protocol.base import API_VERSION, format_id

SNAPSHOT_PATH = "/v2/snapshot"
BLOB_PATH = "/v2/blob/{file_id}/{version}"
PACK_PATH = "/v2/pack/{dir_id}/{index}/{digest}"
PICK_PATH = "/v2/pick/{members}"  # ID-VERSION.ID-VERSION...: the files of an ordered list
CHANGES_PATH = "/v2/changes"
OLD_PATHS = "/v1/{tail:.*}"  # protocol v1's routes, all answered 400 ``protocol-version``
HEALTH_PATH = "/healthz"
METRICS_PATH = "/metrics"
SNAPSHOT_MEDIA_TYPE = "application/vnd.spokefs.snapshot.v1+zlib"
HEADER_ERROR = "X-Spokefs-Error"
HEADER_GENERATION = "X-Spokefs-Generation"
ERROR_PROTOCOL_VERSION = "protocol-version"
# A spoke asks for at most this many bytes of data in one range (hubd streams any range,
# a slice at a time, so this bounds only the spoke's own request and RAM).
MAX_RANGE_BYTES = 16 * 1024 * 1024
CHANGES_MEDIA_TYPE = "application/vnd.spokefs.changes.v1+zlib"


def blob_path(file_id: int, version: int) -> str:
    return BLOB_PATH.format(file_id=format_id(file_id), version=format_id(version))


def etag(file_id: int, version: int) -> str:
    """The ETag of a blob answer: one file version in the v2 (framed) representation."""
    return f'"{format_id(file_id)}-{format_id(version)}-f{API_VERSION}"'
