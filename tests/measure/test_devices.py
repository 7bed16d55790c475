import pytest

from minifloat.gemm import support
from minifloat.measure import devices

CPUINFO = """processor\t: 0
model name\t: Some CPU
flags\t\t: fpu sse2 avx2 fma avx512f {extra} avx512_vnni
bogomips\t: 4000.00
"""


@pytest.mark.parametrize(
    ("extra", "flags", "native_bf16"),
    [("", ["avx2", "fma", "avx512f"], False),
     ("avx512_bf16", ["avx2", "fma", "avx512f", "avx512_bf16"], True),
     ("amx_bf16 amx_tile", ["avx2", "fma", "avx512f", "amx_bf16"], True),
     ("amx_fp16", ["avx2", "fma", "avx512f", "amx_fp16"], False)],
)  # fmt: skip
def test_cpu_flags_and_native_bf16_from_cpuinfo(tmp_path, monkeypatch, extra, flags, native_bf16):
    (tmp_path / "cpuinfo").write_text(CPUINFO.format(extra=extra))
    monkeypatch.setattr(support, "CPUINFO", str(tmp_path / "cpuinfo"))
    assert support.cpu_flags() == flags
    assert support.native_bf16_cpu() is native_bf16
    assert devices.describe()["devices"][0]["detail"].endswith("ISA: " + " ".join(flags))


def test_without_cpuinfo_no_flag_is_assumed(tmp_path, monkeypatch):
    monkeypatch.setattr(support, "CPUINFO", str(tmp_path / "missing"))
    assert support.cpu_flags() == [] and support.native_bf16_cpu() is False
    assert devices.describe()["devices"][0]["detail"].endswith("ISA: unknown")
