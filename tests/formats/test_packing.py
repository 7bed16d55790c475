import pytest
import torch

from minifloat import CodeRangeError, DTypeError, PackingError, pack, packed_nbytes, unpack
from tests.conftest import FORMAT_NAMES


def _oracle_pack(codes: list[int], bits: int) -> list[int]:
    """Independent reference: a little-endian bit stream built with Python integers."""
    per_group = {4: 2, 6: 4, 8: 1}[bits]
    codes = codes + [0] * (-len(codes) % per_group)
    stream = sum(c << (bits * i) for i, c in enumerate(codes))
    return list(stream.to_bytes(len(codes) * bits // 8, "little"))


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 8, 13, 64, 1001])
def test_round_trip_and_layout_any_length(name, n):
    bits = {"e4m3": 8, "e5m2": 8, "e4m3fnuz": 8, "e5m2fnuz": 8, "e8m0": 8, "e3m2": 6, "e2m3": 6, "e2m1": 4}[name]
    g = torch.Generator().manual_seed(n)
    codes = torch.randint(0, 2**bits, (n,), generator=g, dtype=torch.int64).to(torch.uint8)
    data = pack(codes, name)
    assert data.dtype == torch.uint8 and data.numel() == packed_nbytes(n, name)
    assert data.tolist() == _oracle_pack(codes.tolist(), bits)
    assert torch.equal(unpack(data, name, n), codes)


def test_fp4_first_element_in_low_nibble():
    assert pack(torch.tensor([0x1, 0xF, 0x7], dtype=torch.uint8), "e2m1").tolist() == [0xF1, 0x07]


def test_fp6_documented_layout():
    # c0=0b000001 c1=0b000010 c2=0b000011 c3=0b111111 -> w = 0xFC3081
    assert pack(torch.tensor([1, 2, 3, 63], dtype=torch.uint8), "e3m2").tolist() == [0x81, 0x30, 0xFC]


def test_pack_any_shape_is_row_major():
    codes = torch.arange(12, dtype=torch.uint8).view(3, 4) % 16
    assert torch.equal(unpack(pack(codes.t(), "e2m1"), "e2m1", 12), codes.t().reshape(-1))


def test_packing_errors():
    with pytest.raises(CodeRangeError, match="code 16 does not fit e2m1"):
        pack(torch.tensor([16], dtype=torch.uint8), "e2m1")
    with pytest.raises(PackingError, match="5 e2m1 codes pack into 3 bytes, but data has 2"):
        unpack(torch.zeros(2, dtype=torch.uint8), "e2m1", 5)
    with pytest.raises(DTypeError, match="torch.uint8 tensor that pack returned, got torch.int32"):
        unpack(torch.zeros(2, dtype=torch.int32), "e2m1", 4)
    with pytest.raises(PackingError, match="non-negative int"):
        unpack(torch.zeros(2, dtype=torch.uint8), "e2m1", -1)
