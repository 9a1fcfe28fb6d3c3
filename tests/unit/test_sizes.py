"""parse_bytes and format_bytes: the sizes a user writes ("20GiB", "1.5 MB") and the ones printed."""

import pytest

from hf_memstack import format_bytes, parse_bytes


def test_parse_and_format_bytes():
    assert parse_bytes("20GiB") == 20 * 2**30
    assert parse_bytes("1.5 MB") == 1_500_000
    assert parse_bytes(1024) == 1024
    assert format_bytes(1536) == "1.50 KiB"
    with pytest.raises(ValueError, match=r"budget='20 parsecs' is not a size.*'20GiB'"):
        parse_bytes("20 parsecs")
    with pytest.raises(ValueError, match="must be positive"):
        parse_bytes("-3GiB")
    with pytest.raises(TypeError, match="budget=True"):
        parse_bytes(True)
    for bad in ("nan", "inf", "1e400", float("nan"), float("inf")):
        with pytest.raises(ValueError, match="is not a finite size"):
            parse_bytes(bad, field="--memory-budget")
    with pytest.raises(ValueError, match="larger than any machine"):
        parse_bytes("1e30")
