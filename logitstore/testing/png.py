"""A PNG file's pixel size, read from its header: what a report's pictures are checked against."""

from __future__ import annotations

import struct


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])
