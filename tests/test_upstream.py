"""The router's relay client (``serving/upstream.py``): the chunked framing it reads back, fed
in any pieces. Its exchanges with real engines are tested through the router
(test_router.py, test_launch.py, test_api_fuzz.py)."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pdinfer.serving.upstream import UpstreamError, _Dechunker


def chunked(pieces: list[bytes], extension: bool) -> bytes:
    ext = b";name=value" if extension else b""
    return b"".join(b"%x%s\r\n%s\r\n" % (len(p), ext, p) for p in pieces if p) + b"0\r\n\r\n"


@settings(max_examples=300, deadline=None, database=None)
@given(
    pieces=st.lists(st.binary(min_size=1, max_size=2000) | st.binary(max_size=4), max_size=8),
    extension=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=80_000), max_size=10),
)
@example(pieces=[b"x" * 5000, b"y" * 70_000, b"z"], extension=False, cuts=[])
@example(pieces=[b"x" * 5000, b"y" * 70_000, b"z"], extension=True, cuts=[3, 4, 5006, 5008, 40_000])
def test_any_split_of_a_chunked_body_gives_back_its_bytes(pieces, extension, cuts):
    wire = chunked(pieces, extension)
    bounds = sorted({0, len(wire), *(c for c in cuts if c < len(wire))})
    reader = _Dechunker()
    out = b"".join(reader.feed(wire[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert out == b"".join(pieces)
    assert reader.done


def test_nothing_after_the_last_chunk_is_read_as_body():
    reader = _Dechunker()
    assert reader.feed(b"3\r\nabc\r\n0\r\n\r\n3\r\nxyz\r\n") == b"abc"
    assert reader.done


@pytest.mark.parametrize("wire", [b"zz\r\nabc\r\n", b"3\r\nabcXY", b"1" * 2000])
def test_a_malformed_chunked_body_is_an_error(wire):
    with pytest.raises(UpstreamError):
        _Dechunker().feed(wire)
