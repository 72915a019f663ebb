"""Tile tables per GPU (`qfuse.kernels.triton.tile.GpuTable`): a GPU reads its own table where it has one,
the first measured elsewhere; the buckets are the same on every GPU."""

import pytest

from qfuse.kernels.triton import int4_mm, int4_planes, scaled_mm, w8a16_mm
from qfuse.kernels.triton.tile import GpuTable, Tile

H100_TILE, H200_TILE = Tile(16, 64, 128, 1, 4, 3), Tile(16, 128, 128, 1, 8, 3)


def test_a_gpu_reads_its_own_table_and_others_the_first(monkeypatch):
    from qfuse.kernels.triton import tile

    table = GpuTable(H100={16: H100_TILE, 32: H100_TILE}, H200={16: H200_TILE, 32: H100_TILE})
    for device_name, gpu, expected in (("NVIDIA H200", "H200", H200_TILE), ("NVIDIA H100 80GB HBM3", "H100", H100_TILE),
                                       ("NVIDIA A100-SXM4-80GB", "H100", H100_TILE), ("", "H100", H100_TILE)):
        monkeypatch.setattr(tile, "_current_device_name", lambda name=device_name: name)
        assert table.gpu_of(device_name) == gpu and table[16] == expected
        assert table.measured_here().startswith(f"measured on an {gpu}")
        assert ("none on this" in table.measured_here()) == (device_name.startswith("NVIDIA A100"))
    assert list(table) == [16, 32] and max(table) == 32 and len(table) == 2 and table.get(64) is None
    assert GpuTable(H20={1: 0}, H200={1: 1}).gpu_of("NVIDIA H200") == "H200"  # the longest name that matches


def test_every_gpu_table_has_the_same_buckets():
    with pytest.raises(ValueError, match="H200 table's keys"):
        GpuTable(H100={16: H100_TILE, 32: H100_TILE}, H200={16: H200_TILE})


@pytest.mark.parametrize("table", [int4_planes.PLANE_TILES, int4_planes.PROGRAMS_PER_SM, int4_mm.BATCHED_TILES,
                                   w8a16_mm.BATCHED_TILES, scaled_mm.CONFIGS, scaled_mm.DECODE_TILES])
def test_the_measured_tables_name_the_gpu_they_were_measured_on(table):
    assert isinstance(table, GpuTable) and set(table.by_gpu) <= {"H100", "H200"}
